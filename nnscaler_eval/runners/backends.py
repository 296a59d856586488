"""Backends: what turns a captured graph into the callable run on a cache hit.

A backend is what `torch.compile` accepts: a callable `backend(gm, example_inputs)
-> callable`, or a name.  "eager" (the default) is handled here without torch._dynamo:
the graph becomes straight-line generated Python (nnscaler_eval.runners.codegen), which runs
CPU kernels on CPU tensors and CUDA kernels on CUDA tensors.  Any other name is looked
up in torch's backend registry ("inductor", "aot_eager", "cudagraphs", ...).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from nnscaler_eval import _C
from nnscaler_eval.runners import (
    backend_form,
    block_reuse,
    inductor_start,
    size_buckets,
    subgraph_schemas,
)


def resolve_backend(backend: Any) -> tuple[Optional[Callable[..., Any]], str]:
    """(callable or None for eager, display name); raises a clear error for bad input."""
    if backend is None or backend == "eager":
        return None, "eager"
    if isinstance(backend, str) and backend in BUILTIN_BACKENDS:
        return BUILTIN_BACKENDS[backend], backend
    if isinstance(backend, str):
        # Here, not at the top: importing torch._dynamo takes seconds, and only
        # a backend named by a string needs its registry.
        from torch._dynamo.backends.registry import list_backends, lookup_backend

        try:
            return lookup_backend(backend), backend
        except Exception as exc:  # torch raises InvalidBackend
            known = ", ".join(["eager"] + sorted(set(list_backends(exclude_tags=())) - {"eager"}))
            raise ValueError(
                f"nnscaler.compile(): unknown backend {backend!r}; known backends: {known}"
            ) from exc
    if callable(backend):
        return backend, getattr(backend, "__name__", type(backend).__name__)
    raise TypeError(
        f"nnscaler.compile(): backend must be a name or a callable(gm, example_inputs), "
        f"not {type(backend).__name__}"
    )


def compile_graph(backend_fn: Callable[..., Any], gm: Any, example_inputs: list[Any]) -> Any:
    """`backend_fn(gm, example_inputs)`, with AOTAutograd told to compile the backward
    now: by default it compiles it at the first `backward()` of the compiled code,
    which for us is the second step (the first runs the capture), a stall in the
    middle of it that nobody asked for.  A backend that does not use AOTAutograd
    ignores the setting; one whose backward fails to compile fails here, where the
    caller falls back to the eager runner, and not in the middle of a backward.
    (A backward compiled before it runs donates saved tensors' memory, so a
    `backward(retain_graph=True)` of the compiled code raises torch's error, which
    names the setting that avoids it; a lazy one picks by its first backward.)

    The graph is handed over as Dynamo hands its graphs (runners/backend_form.py): in
    a `TracingContext` whose fake mode has a `ShapeEnv`, its nodes carrying
    `meta["example_value"]`, which Inductor's FX graph cache and AOTAutograd's cache
    need before they keep anything across processes.  torch's training check of a
    shared block is asked once per block (runners/subgraph_schemas.py), and Inductor
    reuses no buffer of a graph that calls one (`block_reuse.compile_settings`: its
    reuse overwrites a block's input the backward still needs).  Inductor's
    per-process start, begun earlier by runners/inductor_start.py, goes on beside it:
    Inductor's own questions wait for it."""
    # Here, not at the top: torch does not import it, and it costs about 15 ms that
    # only a compiling backend needs.
    from torch._functorch import config as functorch_config

    inductor_start.ready()
    with functorch_config.patch(force_non_lazy_backward_lowering=True), \
            backend_form.as_dynamo_hands_it(gm, example_inputs), \
            subgraph_schemas.asked_once(gm), block_reuse.compile_settings(gm):
        return backend_fn(gm, example_inputs)


def cudagraphs(gm: Any, example_inputs: list[Any]) -> Callable[..., Any]:
    """Record the graph into a CUDA graph (torch.cuda's graph API owns the memory
    pool) and return its replay, a C callable (`_C.GraphReplay`, csrc/graph_replay.h):
    it copies the inputs not already at the recorded addresses into the static input
    buffers, replays, copies back into the caller's tensors the inputs the graph
    writes in place (a static KV cache's `index_copy_`), and returns copies of the
    static outputs.  Parameters and buffers are attributes of the graph, read in place
    by the recording: never copied.

    Inference only, concrete sizes only: it refuses (and the caller then runs the graph
    with the eager backend, with one warning, or, for a dynamic capture, records one
    graph per concrete size) when no CUDA device is present, when an input is not a
    CUDA tensor, when an example input is symbolic (a recording of fake tensors would
    replay nothing and hand fake outputs to the caller), or when autograd would be
    needed.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cudagraphs needs a CUDA device and none is available")
    refuse_replay(gm, example_inputs, "cuda")
    return replayed(gm, example_inputs, _record_cuda)


def refuse_replay(gm: Any, example_inputs: list[Any], device_type: str) -> None:
    """Raise, saying why, when a recording of `gm` could not replay these inputs:
    symbolic or fake inputs, an input that is neither a tensor of `device_type` nor a
    plain int, float or bool (the recording's own: a call must pass it again), or
    autograd needed (grad mode on with an input or a parameter requiring grad)."""
    symbolic = [i for i, t in enumerate(example_inputs)
                if isinstance(t, (torch.SymInt, torch.SymFloat, torch.SymBool))
                or (isinstance(t, torch.Tensor) and is_fake(t))]
    if symbolic:
        raise ValueError(f"a graph recording takes concrete sizes; inputs {symbolic} are "
                         "symbolic")
    off_device = [i for i, t in enumerate(example_inputs)
                  if not (isinstance(t, torch.Tensor) and t.device.type == device_type
                          or type(t) in (int, float, bool))]
    if off_device:
        raise ValueError(f"a {device_type} graph recording needs every graph input to be a "
                         f"tensor on a {device_type} device (or an int, float or bool, "
                         f"recorded as it is); inputs {off_device} are not")
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and (any(t.requires_grad for t in tensors)
                                    or any(p.requires_grad for p in gm.parameters())):
        raise ValueError("a graph recording is inference only: call under torch.no_grad() "
                         "(or with requires_grad=False everywhere)")


# Recordings of one graph for other pinned tensors (a new static KV cache per
# generate() call): past this many, the oldest is dropped (its memory with it).
MOVED_RECORDINGS = 8

Record = Callable[[Any, list[Any]], tuple[Callable[[], Any], Any]]


def replayed(gm: Any, example_inputs: list[Any], record: Record) -> Any:
    """The replay of `gm` recorded by `record(gm, static_inputs) -> (replay, outputs)`,
    which runs the graph on the static input buffers as often as its recording needs
    (warm-up included) and returns the callable that runs the recording again and the
    recording's outputs.

    The buffers are copies of the example inputs, except for pinned tensors: those
    marked with `torch._dynamo.mark_static_address`, and those the graph writes in
    place that the call reached through an argument's items or attributes (a cache
    object's buffers, which live across calls: transformers' StaticCache marks its
    tensors only outside a compiler's trace).  A pinned input's buffer is the
    caller's tensor (never copied), and what the recording's runs wrote into it is
    undone after them.  A later call with other pinned tensors is recorded again for
    them (at most MOVED_RECORDINGS kept): never a copy into the caller's earlier
    tensor.  Which inputs the graph writes in place is read from their version
    counters across `record`: a view's write moves its base's."""
    return _Recordings(gm, record).record(list(example_inputs))


class _Recordings:
    """One graph's recordings: the first, then one per other set of pinned tensors."""

    def __init__(self, gm: Any, record: Record) -> None:
        self.gm = gm
        self.record_fn = record
        self.pinned: tuple[int, ...] = ()
        self.moved: dict[tuple, Any] = {}   # pinned tensors' layout -> GraphReplay
        self.warned = False

    def record(self, inputs: list[Any], pinned: Optional[tuple[int, ...]] = None) -> Any:
        self.pinned = self._pinned(inputs) if pinned is None else pinned
        static_inputs = [t if i in self.pinned or not isinstance(t, torch.Tensor) else t.clone()
                         for i, t in enumerate(inputs)]
        saved = {i: inputs[i].clone() for i in self.pinned}
        versions = [getattr(t, "_version", None) for t in static_inputs]
        replay, static_outputs = self.record_fn(self.gm, static_inputs)
        written = tuple(i for i, (t, v) in enumerate(zip(static_inputs, versions))
                        if v is not None and t._version != v)
        with torch.no_grad():
            for i in self.pinned:
                if i in written:   # the recording's runs wrote the caller's tensor
                    static_inputs[i].copy_(saved[i])
        single = not isinstance(static_outputs, (tuple, list))
        outputs = (static_outputs,) if single else tuple(static_outputs)
        return _C.GraphReplay(tuple(static_inputs), replay, written, outputs, single=single,
                              pinned=self.pinned, moved=self.moved_call if self.pinned else None)

    def _pinned(self, inputs: list[Any]) -> tuple[int, ...]:
        marked = {i for i, t in enumerate(inputs)
                  if getattr(t, "_dynamo_static_input_type", None) is not None}
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        state = {i for i, node in enumerate(placeholders)
                 if getattr(node.meta.get("nnscaler_input"), "keys", ())
                 and isinstance(inputs[i], torch.Tensor)} - marked
        if state:   # which of them the graph writes: one run on copies
            probe = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
            versions = {i: probe[i]._version for i in state}
            with torch.no_grad():
                self.gm(*probe)
            state = {i for i in state if probe[i]._version != versions[i]}
        return tuple(sorted(marked | state))

    def _layout(self, inputs: tuple[Any, ...]) -> tuple:
        return tuple((inputs[i].data_ptr(), tuple(inputs[i].shape), inputs[i].stride(),
                      inputs[i].dtype, inputs[i].device) for i in self.pinned)

    def moved_call(self, *inputs: Any) -> Any:
        """A call whose pinned tensors are not the first recording's: the recording for
        them (made now if new), replayed; a tuple of outputs, as the first one's."""
        layout = self._layout(inputs)
        replay = self.moved.pop(layout, None)
        if replay is None:
            if len(self.moved) >= MOVED_RECORDINGS:
                self.moved.pop(next(iter(self.moved)))   # the least recently used
                if not self.warned:
                    self.warned = True
                    warnings.warn(
                        f"nnscaler: a CUDA-graph entry met more than {MOVED_RECORDINGS} sets "
                        "of static-address tensors (torch._dynamo.mark_static_address); the "
                        "least recently used recording is dropped and made again when met",
                        RuntimeWarning, stacklevel=2)
            replay = _Recordings(self.gm, self.record_fn).record(list(inputs), self.pinned)
        self.moved[layout] = replay
        result = replay(*inputs)
        return (result,) if replay.single else result


# One memory pool per graph: every recording of an entry (per size, per set of pinned
# tensors) allocates from it.  Safe because a replay's outputs are cloned before any
# other recording of the graph replays: a recording may reuse memory another one's
# intermediates used, never memory the caller still reads.
_pools: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _record_cuda(gm: Any, static_inputs: list[Any]) -> tuple[Callable[[], Any], Any]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: lazy initialisation outside the recording
            gm(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_pools.get(gm)):
        static_outputs = gm(*static_inputs)
    _pools.setdefault(gm, graph.pool())
    return graph.replay, static_outputs


# Names this project implements itself; everything else comes from torch's registry.
BUILTIN_BACKENDS: dict[str, Callable[..., Any]] = {"cudagraphs": cudagraphs}


class PerSizeCompiled:
    """A dynamic capture's graph for a backend that refused its symbolic example
    inputs (a backend that needs concrete sizes, such as CUDA graphs): compiled once
    per concrete set of input sizes and int values, from the first hit's own
    arguments, under the same capture (no recapture).  Past `limit` compiles, or where
    the backend refuses a concrete size too, that size runs the graph itself (the
    eager backend); `failed(exc)` / `full()` say so (once, the caller decides).
    codegen writes the lookup into the runner.

    With a bucket plan (runners/size_buckets.py, `size_buckets=True`), a size whose
    power-of-two bucket the plan allows runs that bucket's recording (one compile for
    every size of the bucket), when the backend's result is a replay
    (`_C.GraphReplay`) whose input buffers can be written in place.
    """

    def __init__(self, backend_fn: Callable[..., Any], graph: Any, limit: int,
                 refusal: str, failed: Callable[[Exception], None],
                 full: Callable[[], None],
                 buckets: Optional[size_buckets.BucketPlan] = None) -> None:
        self.backend_fn = backend_fn
        self.graph = graph
        self.limit = limit
        self.refusal = refusal   # why the symbolic compile failed, for explain()
        self.failed = failed
        self.full = full
        self.buckets = buckets
        self.buckets_note = ""   # the sizes padded, or why none (explain())
        self.compiles = 0
        self.compiled: dict[tuple, Callable[..., Any]] = {}

    def compile_for(self, size: tuple, *args: Any) -> Callable[..., Any]:
        """The callable for `size` (each argument's shape, or its value: the runner
        looks it up in `compiled` inline and calls this only for a size it has not
        met, so a hit of a known size runs no Python of ours)."""
        compiled = self._bucketed(args) if self.buckets is not None else None
        if compiled is None:
            compiled = self._compile(list(args)) or self.graph
        # Two threads compiling one size at once both store a working callable.
        self.compiled.setdefault(size, compiled)
        return self.compiled[size]

    def _compile(self, args: list[Any]) -> Optional[Callable[..., Any]]:
        if self.compiles >= self.limit:
            self.full()
            return None
        try:
            result = compile_graph(self.backend_fn, self.graph, args)
            if not callable(result):
                raise TypeError(f"it returned {type(result).__name__}, not a callable")
        except Exception as exc:
            self.failed(exc)
            return None
        self.compiles += 1
        return result

    def _bucketed(self, args: tuple) -> Optional[Callable[..., Any]]:
        """The call of this size through its bucket's recording, or None (no bucket
        for it: the caller compiles the size itself)."""
        plan = self.buckets
        assert plan is not None
        values = plan.values(args)
        target = plan.bucket(values) if values is not None else None
        padded = [i for i, dims in enumerate(plan.inputs) if isinstance(dims, tuple) and dims]
        if target is None or any(getattr(args[i], "_dynamo_static_input_type", None)
                                 is not None for i in padded):
            return None   # a pinned tensor is used in place: never padded
        bucket_args = plan.padded_args(args, target)
        key = plan.size_key(bucket_args)
        replay = self.compiled.get(key)
        if replay is None:
            replay = self._compile(bucket_args)
            if replay is None:
                return None
            replay = self.compiled.setdefault(key, replay)
            if not isinstance(replay, _C.GraphReplay):
                self.buckets = None   # not a recording: buckets would save nothing
                return None
        if not isinstance(replay, _C.GraphReplay) or set(replay.pinned) & set(padded):
            return None
        return size_buckets.bucket_call(replay, plan, values)
