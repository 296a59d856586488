"""Backends: what turns a captured graph into the callable run on a cache hit.

A backend is what `torch.compile` accepts: a callable `backend(gm, example_inputs)
-> callable`, or a name.  "eager" (the default) is handled here without torch._dynamo:
the graph becomes straight-line generated Python (nnscaler_eval.runners.codegen), which runs
CPU kernels on CPU tensors and CUDA kernels on CUDA tensors.  Any other name is looked
up in torch's backend registry ("inductor", "aot_eager", "cudagraphs", ...).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from nnscaler_eval import _C
from nnscaler_eval.runners import backend_form, inductor_start


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
    now: by default it compiles it at the first `backward()`, a second stall in the
    middle of the first training step that nobody asked for (torch.compile()'s
    Inductor path compiles both up front).  A backend that does not use AOTAutograd
    ignores the setting; one whose backward fails to compile fails here, where the
    caller falls back to the eager runner, and not in the middle of a backward.

    The graph is handed over as Dynamo hands its graphs (runners/backend_form.py): in
    a `TracingContext` whose fake mode has a `ShapeEnv`, its nodes carrying
    `meta["example_value"]`, which Inductor's FX graph cache and AOTAutograd's cache
    need before they keep anything across processes.  Inductor's per-process start,
    begun earlier by runners/inductor_start.py, is finished first."""
    # Here, not at the top: torch does not import it, and it costs about 15 ms that
    # only a compiling backend needs.
    from torch._functorch import config as functorch_config

    inductor_start.finish()
    with functorch_config.patch(force_non_lazy_backward_lowering=True), \
            backend_form.as_dynamo_hands_it(gm, example_inputs):
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
    symbolic or fake inputs, an input that is not a tensor of `device_type`, or
    autograd needed (grad mode on with an input or a parameter requiring grad)."""
    symbolic = [i for i, t in enumerate(example_inputs)
                if isinstance(t, (torch.SymInt, torch.SymFloat, torch.SymBool))
                or (isinstance(t, torch.Tensor) and is_fake(t))]
    if symbolic:
        raise ValueError(f"a graph recording takes concrete sizes; inputs {symbolic} are "
                         "symbolic")
    off_device = [i for i, t in enumerate(example_inputs)
                  if not (isinstance(t, torch.Tensor) and t.device.type == device_type)]
    if off_device:
        raise ValueError(f"a {device_type} graph recording needs every graph input on a "
                         f"{device_type} device; inputs {off_device} are not")
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and (any(t.requires_grad for t in tensors)
                                    or any(p.requires_grad for p in gm.parameters())):
        raise ValueError("a graph recording is inference only: call under torch.no_grad() "
                         "(or with requires_grad=False everywhere)")


def replayed(gm: Any, example_inputs: list[Any],
             record: Callable[[Any, list[Any]], tuple[Callable[[], Any], Any]]) -> Any:
    """The replay of `gm` recorded by `record(gm, static_inputs) -> (replay, outputs)`,
    which runs the graph on the static input buffers as often as its recording needs
    (warm-up included) and returns the callable that runs the recording again and the
    recording's outputs.  Which inputs the graph writes in place is read from their
    version counters across `record`: a view's write moves its base's."""
    static_inputs = [t.clone() for t in example_inputs]
    versions = [t._version for t in static_inputs]
    replay, static_outputs = record(gm, static_inputs)
    written = tuple(i for i, (t, v) in enumerate(zip(static_inputs, versions))
                    if t._version != v)
    single = not isinstance(static_outputs, (tuple, list))
    outputs = (static_outputs,) if single else tuple(static_outputs)
    return _C.GraphReplay(tuple(static_inputs), replay, written, outputs, single=single)


def _record_cuda(gm: Any, static_inputs: list[Any]) -> tuple[Callable[[], Any], Any]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: lazy initialisation outside the recording
            gm(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = gm(*static_inputs)
    return graph.replay, static_outputs


# Names this project implements itself; everything else comes from torch's registry.
BUILTIN_BACKENDS: dict[str, Callable[..., Any]] = {"cudagraphs": cudagraphs}


class PerSizeCompiled:
    """A dynamic capture's graph for a backend that refused its symbolic example
    inputs (a backend that needs concrete sizes, such as CUDA graphs): compiled once
    per concrete set of input sizes and int values, from the first hit's own
    arguments, under the same capture (no recapture).  Past `limit` sizes, or where
    the backend refuses a concrete size too, that size runs the graph itself (the
    eager backend); `failed(exc)` / `full()` say so (once, the caller decides).
    codegen writes the lookup into the runner.
    """

    def __init__(self, backend_fn: Callable[..., Any], graph: Any, limit: int,
                 refusal: str, failed: Callable[[Exception], None],
                 full: Callable[[], None]) -> None:
        self.backend_fn = backend_fn
        self.graph = graph
        self.limit = limit
        self.refusal = refusal   # why the symbolic compile failed, for explain()
        self.failed = failed
        self.full = full
        self.compiled: dict[tuple, Callable[..., Any]] = {}

    def compile_for(self, size: tuple, *args: Any) -> Callable[..., Any]:
        """The callable for `size` (each argument's shape, or its value: the runner
        looks it up in `compiled` inline and calls this only for a size it has not
        met, so a hit of a known size runs no Python of ours)."""
        compiled: Callable[..., Any] = self.graph
        if len(self.compiled) >= self.limit:
            self.full()
        else:
            try:
                result = compile_graph(self.backend_fn, self.graph, list(args))
                if not callable(result):
                    raise TypeError(f"it returned {type(result).__name__}, not a callable")
                compiled = result
            except Exception as exc:
                self.failed(exc)
        # Two threads compiling one size at once both store a working callable.
        self.compiled.setdefault(size, compiled)
        return self.compiled[size]
