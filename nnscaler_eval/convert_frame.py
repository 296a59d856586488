"""The miss path: what happens, in Python, when the C evaluator finds no valid cache
entry for a target frame.

C calls `convert_frame(config, fn, code, self, slots, bucket, key)` with its hook
suspended for this thread.  `fn` runs the frame's (rewritten) code; `slots` are the
frame's bound arguments; `key` is the call key C built for them (a `_C.CallKey`, stored
with the entry this returns), described here only through `_C.describe_call_key`, so
that logs and `explain()` show the bytes the hit path compares.  This runs the forward
once under the capture tracer (its result *is* the call's result: side effects happen
once), builds the guards and the runner, and returns `(result, CacheEntry)`; or
`(RUN_EAGERLY, None)` to have C evaluate the frame as it is (cache limit reached, or
our own failure before the forward ran).  Exceptions raised by the user's forward
propagate unchanged.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch._guards import TracingContext

from nnscaler_eval import _C, logs
from nnscaler_eval import capture as tracer
from nnscaler_eval.capture import dynamic, training, unwinding
from nnscaler_eval.capture.passed_objects import describe_writes
from nnscaler_eval.capture import hook_nodes
from nnscaler_eval.guarding import keyed_objects
from nnscaler_eval.guarding import state_guards
from nnscaler_eval.tracing import trace_state
from nnscaler_eval.tracing.compile_awareness import compile_safe_paths
from nnscaler_eval.shared_objects import INTERNAL_PREFIX, RUN_DISARMED, RUN_EAGERLY
from nnscaler_eval.config import CompileConfig, adopt_region_bucket
from nnscaler_eval.runners import block_reuse, inductor_start
from nnscaler_eval.runners import size_buckets
from nnscaler_eval.runners.backends import PerSizeCompiled, compile_graph
from nnscaler_eval.runners.fx_source import release_source_with
from nnscaler_eval.guarding.guard_builder import ReadContext, build_state_guards, walk_state

# Code objects that own cache buckets, for reset().
known_codes: "weakref.WeakSet[Any]" = weakref.WeakSet()

_local = threading.local()


@dataclass
class EntryInfo:
    """What `explain()` and the logs show of one cache entry."""
    where: str                         # "Model.forward at file:line"
    key: list[str]                     # the per-call key in words (_C.describe_call_key)
    guards: list[str]                  # state guards, in words
    graph_module: Optional[torch.fx.GraphModule]
    fallback: Any                      # tracer.Fallback or None
    backend: str
    runner: Optional[Callable[..., Any]] = field(default=None, repr=False)
    not_guarded: list[str] = field(default_factory=list)   # state beyond the guard walk
    global_state: Any = field(default=None, repr=False)    # torch GlobalStateGuard
    # plain values the runner writes to modules after the graph: (path, name, value)
    state_writes: tuple = ()
    # a dynamic entry's symbols ("x.size(1) (s0) in [2, int_oo]") and shape guards
    symbols: list = field(default_factory=list)
    shape_guards: list = field(default_factory=list)
    symbolic_ok: bool = False   # the capture could be made again on fake inputs
    # what the runner writes into KV caches passed in, in words
    # (codegen.OutputLayout.writes: "cache.layers[0].keys = graph output 2")
    object_writes: list = field(default_factory=list)
    # why the backend compiles this dynamic entry once per size (it refused symbolic
    # inputs), or None
    per_size: Optional[str] = None
    # what size buckets do for such an entry (compile(size_buckets=True)): the sizes
    # padded, or why none; "" without the option
    size_buckets: str = ""
    # the subgraphs the backend compiled once for repeated blocks (block_reuse.SharedBlock)
    shared_blocks: list = field(default_factory=list)
    # `if` statements on tensors the capture met: converted to torch.cond, or why not
    # (capture/branches.py, BranchNote)
    branches: list = field(default_factory=list)

    @property
    def graph_code(self) -> str:
        return self.graph_module.code if self.graph_module is not None else ""


class _Collector:
    """Collects EntryInfo of captures made on this thread (explain())."""

    def __init__(self) -> None:
        self.entries: list[EntryInfo] = []

    def __enter__(self) -> "_Collector":
        self._previous = getattr(_local, "collector", None)
        _local.collector = self
        return self

    def __exit__(self, *exc: object) -> None:
        _local.collector = self._previous


def collect_captures() -> _Collector:
    return _Collector()


def code_location(code: Any) -> str:
    return f"{code.co_qualname} at {code.co_filename}:{code.co_firstlineno}"


def slot_call(fn: Callable[..., Any], code: Any, slots: tuple,
              depth: Optional[int] = None) -> Callable[[], Any]:
    """A zero-argument callable that runs `fn` with the frame's slots rebound.

    With `depth` (the recursion depth the frame was called at), `fn` runs with the
    recursion budget it would have had there: the units of convert_frame and the
    tracer in between are credited to this thread for the call (csrc/recursion.h).
    No Python frame of its own: a partial of a C function."""
    npos, nkw = code.co_argcount, code.co_kwonlyargcount
    names = code.co_varnames
    pos = slots[:npos]
    kwonly = {names[npos + j]: slots[npos + j] for j in range(nkw)}
    index = npos + nkw
    varargs: tuple = ()
    varkw: dict = {}
    if code.co_flags & inspect.CO_VARARGS:
        varargs = slots[index]
        index += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        varkw = slots[index]
    return functools.partial(_C.call_at_depth, depth, fn, *pos, *varargs, **kwonly, **varkw)


def _failing_guard(entry: Any) -> Optional[str]:
    failing = entry.check_verbose()
    if failing is not None and failing.startswith("global torch state"):
        state = entry.info.global_state
        reason = state.reason() if state is not None else ""
        return f"{failing}: {reason.strip() or 'changed'}"
    return failing


def _log_recapture(code: Any, bucket: Any, key: list[str]) -> None:
    dropped = bucket.take_dropped()   # entries the C lookup removed as stale
    if not logs.recaptures.isEnabledFor(10) or not (bucket.entries or dropped):
        return
    reasons = [f"guard failed (entry dropped): {name}" for name in dropped]
    for entry in bucket.entries:
        info = entry.info
        failing = _failing_guard(entry)
        if info.key != key:
            diffs = [f"{old} -> {new}" for old, new in zip(info.key, key) if old != new]
            reasons.append("key changed: " + "; ".join(diffs))
        elif failing is not None:
            reasons.append(f"guard failed: {failing}")
    logs.recaptures.debug("recapture of %s: %s", code_location(code),
                          " | ".join(reasons) or "no entry matched")


def warn_at_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn naming the first frame outside nnscaler_eval and torch: the user's line."""
    frame = sys._getframe(1)
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    while frame is not None and frame.f_code.co_filename.startswith((INTERNAL_PREFIX, torch_dir)):
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__", "?"),
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))


def _over_limit(config: CompileConfig, code: Any, bucket: Any) -> bool:
    if trace_state.entries_with_in_flight(bucket) < config.cache_size_limit:
        return False
    if not bucket.limit_warned:
        bucket.limit_warned = 1
        warn_at_user(
            f"nnscaler: {code_location(code)} reached cache_size_limit="
            f"{config.cache_size_limit} captures for one module; further new input "
            f"signatures run eagerly (callees included). Raise it with "
            f"nnscaler.compile(..., cache_size_limit=N) if the shapes are expected to vary."
        )
    return True


# code -> the backend failures already warned about for it: (the backend's
# identity, what failed).  Keyed weakly, so a freed forward's code takes its entry
# with it; each distinct failure of each backend warns once, even when two backends
# share a name.
_backend_failures_warned: "weakref.WeakKeyDictionary[Any, set[tuple[int, str]]]" = \
    weakref.WeakKeyDictionary()


def _backend_failed(config: CompileConfig, code: Any, where: str, exc: Exception) -> None:
    """The backend failed on this capture: fullgraph raises; else one warning per
    code and failure, and the caller runs the graph with the eager backend."""
    if config.fullgraph:
        raise RuntimeError(
            f"nnscaler: backend {config.backend_name!r} failed to compile {where}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    _warn_backend_once(config, code, f"{type(exc).__name__}: {exc}",
                       f"failed to compile {where} ({type(exc).__name__}: {exc}); running "
                       "the captured graph with the eager backend instead")


def _backend_full(config: CompileConfig, code: Any, where: str) -> None:
    """A per-size backend reached cache_size_limit sizes: one warning per code."""
    _warn_backend_once(config, code, "per-size limit",
                       f"compiled {where} for {config.cache_size_limit} sizes "
                       "(cache_size_limit); further sizes run the captured graph with the "
                       "eager backend")


def _warn_backend_once(config: CompileConfig, code: Any, failure: str, message: str) -> None:
    """`nnscaler: backend <name> <message>`, once per code, backend and failure."""
    warned = _backend_failures_warned.setdefault(code, set())
    if (id(config.backend_fn), failure) not in warned:
        warned.add((id(config.backend_fn), failure))
        warn_at_user(f"nnscaler: backend {config.backend_name!r} {message}")


def _compile_runner(config: CompileConfig, capture: Any, code: Any, where: str,
                    symbolic: bool = False) -> tuple[Callable[..., Any], list[tuple[Any, bool]],
                                                     Optional[PerSizeCompiled], list]:
    """The runner for this capture, the extra flag guards it needs, its per-size
    compiles (None: the backend took the symbolic graph), and the blocks it compiled
    once.

    "eager": the graph as generated Python; training flags stay graph inputs.  Any
    other backend gets the graph with the flags folded to this run's values (AOT
    backends bake non-tensor inputs in anyway), so each such flag is guarded by value.
    A backend that refuses a dynamic capture's symbolic inputs compiles it per size.
    """
    if config.backend_fn is None:
        return capture.make_runner(), [], None, []
    gm, example_inputs = capture.backend_graph()
    per_size = None
    compiled, shared = _compile_shared(config, capture, gm, example_inputs, where)
    try:
        if compiled is None:
            compiled = compile_graph(config.backend_fn, gm, example_inputs)
        if not callable(compiled):
            raise TypeError(f"it returned {type(compiled).__name__}, not a callable")
    except Exception as exc:
        if unwinding.interrupt_in(exc) is not None:   # Ctrl-C reaches the caller
            raise
        refusal = f"{type(exc).__name__}: {exc}"
        if symbolic and (id(config.backend_fn), refusal) not in _backend_failures_warned.get(
                code, ()):
            # (A backend that failed the same way on a static capture of this code
            # fails whatever the sizes: that is not a refusal of symbols.)
            logs.recaptures.info("%s: backend %r refused symbolic inputs (%s); compiled "
                                 "per size", where, config.backend_name, refusal)
            plan, buckets_note = _size_buckets(config, gm, example_inputs, where)
            compiled = per_size = PerSizeCompiled(
                config.backend_fn, gm, config.cache_size_limit, refusal,
                lambda failure: _backend_failed(config, code, where, failure),
                lambda: _backend_full(config, code, where), plan)
            per_size.buckets_note = buckets_note
        else:
            _backend_failed(config, code, where, exc)
            return capture.make_runner(), [], None, []
    n_tensors = len(example_inputs)
    flags = capture.example_inputs()[n_tensors:]
    folded = [(module, bool(value)) for module, value in zip(capture.training_inputs, flags)]
    return capture.make_runner(compiled, training_folded=True), folded, per_size, shared


def _size_buckets(config: CompileConfig, gm: Any, example_inputs: list[Any],
                  where: str) -> tuple[Optional[size_buckets.BucketPlan], str]:
    """The bucket plan of a graph compiled per size, and what explain() says of it."""
    if not config.size_buckets:
        return None, ""
    try:
        plan = size_buckets.plan(gm, example_inputs)
    except size_buckets.Refused as exc:
        logs.recaptures.info("%s: no size buckets: %s", where, exc)
        return None, f"no size buckets: {exc}"
    except Exception as exc:   # the analysis met what it cannot run: no buckets
        if unwinding.interrupt_in(exc) is not None:
            raise
        logs.recaptures.info("%s: no size buckets: %s: %s", where, type(exc).__name__, exc)
        return None, f"no size buckets: the analysis failed ({type(exc).__name__}: {exc})"
    return plan, plan.describe()


def _compile_shared(config: CompileConfig, capture: Any, gm: Any, example_inputs: list[Any],
                    where: str) -> tuple[Optional[Callable[..., Any]], list]:
    """The graph compiled with its repeated blocks as one subgraph each
    (runners/block_reuse.py), and what is shared; (None, []) when the option is off,
    the backend does not trace with AOTAutograd, nothing repeats, or the compile of
    the shared form failed (then the caller compiles the plain graph: a block the
    backend cannot take as a subgraph costs a second compile, never a wrong answer)."""
    if not (config.block_reuse and isinstance(config.backend, str)
            and config.backend in block_reuse.REUSING_BACKENDS):
        return None, []
    if TracingContext.try_get() is not None:
        return None, []   # inside torch.compile's own trace: its graph, its regions
    shared_gm, shared = block_reuse.share_repeated_blocks(gm, example_inputs,
                                                          capture.inline_calls)
    if not shared:
        return None, []
    try:
        compiled = compile_graph(config.backend_fn, shared_gm, example_inputs)
        if not callable(compiled):
            raise TypeError(f"it returned {type(compiled).__name__}, not a callable")
    except Exception as exc:
        if unwinding.interrupt_in(exc) is not None:   # Ctrl-C reaches the caller
            raise
        logs.recaptures.info("%s: backend %r failed on the graph with shared blocks "
                             "(%s: %s); compiling it inlined", where, config.backend_name,
                             type(exc).__name__, exc)
        return None, []
    return compiled, shared


def convert_frame(config: CompileConfig, fn: Callable[..., Any], code: Any, self: Any,
                  slots: tuple, bucket: Any, call_key: Any) -> tuple[Any, Any]:
    # C calls this in place of the intercepted frame: the frame that called the
    # forward is one below this one, and the forward runs at its depth + 1, as in
    # eager, however many frames of ours are on the stack by then.
    caller_depth = _C.recursion_depth() - 1
    if isinstance(self, torch.fx.GraphModule):
        # Already a graph (a backend running or tracing its compiled graph): never
        # captured again, and not looked at again either.
        _C.mark_skip(code)
        return RUN_EAGERLY, None
    # One capture at a time, process-wide (trace_state): a miss while another thread
    # captures runs as in eager, callees included (not captured one by one either),
    # uncached. Released in a `finally`, retried if interrupted.
    # The torch function-mode stack and the function record are restored by C around
    # this call (dispatch.c, capture_state_restore), where no interrupt can land.
    depth = trace_state.capture_depth()
    try:
        if not trace_state.try_enter_capture():
            return RUN_DISARMED, None
        # An interrupt: what it left half done runs on the way out, the modes are put
        # back, and the caller gets the interrupt itself (capture/unwinding.py).
        with unwinding.Boundary():
            return _convert_frame_locked(config, fn, code, self, slots, bucket, call_key,
                                         caller_depth)
    finally:
        trace_state.run_to_completion(trace_state.leave_capture, depth)


def _convert_frame_locked(config: CompileConfig, fn: Callable[..., Any], code: Any, self: Any,
                          slots: tuple, bucket: Any, call_key: Any,
                          caller_depth: int) -> tuple[Any, Any]:
    known_codes.add(code)
    if config.region and isinstance(self, torch.nn.Module):
        adopt_region_bucket(config, self, bucket)
    where = code_location(code)
    slot_names = tuple(code.co_varnames[: len(slots)])
    first = 1 if self is not None else 0
    try:
        if _over_limit(config, code, bucket):
            return RUN_DISARMED, None
        if keyed_objects.register_in(slots[first:]):
            # A KV cache class met for the first time: keyed by its contents from now
            # on, this call's key included (C stores the key object it passed us).
            call_key.rebuild(*slots[first:])
        # The key in words, from its bytes (C): what a later call must equal to hit.
        key = list(_C.describe_call_key(call_key, slot_names[first:]))
        _log_recapture(code, bucket, key)
    except Warning:
        raise
    except Exception as exc:  # our own failure: the frame runs as it is
        if unwinding.interrupt_in(exc) is not None:   # Ctrl-C reaches the caller
            raise
        warn_at_user(f"nnscaler: preparing the capture of {where} failed ({exc!r}); "
                     "running it eagerly")
        return RUN_EAGERLY, None

    if tracer.takes_eval_fast_path(self):
        # Traced, torch's fused eval path is never taken (see calls.py): such a
        # layer runs as eager runs it, here and as an opaque node inside others'
        # graphs.  Guarded on its mode: in training it is captured as usual.
        fallback = tracer.Fallback(
            f"{type(self).__name__} in eval takes torch's fast path, which a trace "
            "cannot take", *_forward_line(code))
        if config.fullgraph:
            raise tracer.GraphBreakError(fallback)
        _make_entry(config, tracer.Capture(None, None, fallback, [], [(self, False)], [], [],
                                           slot_names), code, self, key, where)
        return RUN_EAGERLY, None
    early = (tracer.input_fallback(fn, slots[first:], slot_names[first:])
             or _mutated_before(code, slot_names[first:], slots[first:]))
    if early is not None:
        # Known before running, and a property of the argument's type: the bucket
        # records the type, and from the next call on C runs such calls eagerly
        # before building a key (a KV cache is a new object per generate() call and
        # changes shape every step: keyed entries would each cost a miss, and fill
        # the cache_size_limit).
        fallback, at_fault = early
        if config.fullgraph:
            raise tracer.GraphBreakError(fallback)
        skipped = tracer.Capture(None, None, fallback, [], [], [], [], slot_names)
        _make_entry(config, skipped, code, self, key, where)   # logs and explain() see it
        _add_eager_types(bucket, {at_fault}, str(fallback))
        return RUN_EAGERLY, None
    try:
        fields = dynamic.plan(config, bucket, call_key, slots[first:])
    except Exception as exc:   # our own failure: a static capture, as before
        if unwinding.interrupt_in(exc) is not None:   # Ctrl-C reaches the caller
            raise
        logs.recaptures.info("%s: no dynamic plan (%r)", where, exc)
        fields = None
    if fields is not None:
        reply = _capture_symbolic(config, fn, code, self, slots, slot_names, bucket, key,
                                  call_key, where, caller_depth, fields)
        if reply is not None:
            return reply
    return _capture(config, fn, code, self, slots, slot_names, bucket, key, where,
                    caller_depth)


def _capture_symbolic(config: CompileConfig, fn: Callable[..., Any], code: Any, self: Any,
                      slots: tuple, slot_names: tuple, bucket: Any, key: list[str],
                      call_key: Any, where: str, caller_depth: int,
                      fields: frozenset) -> Any:
    """A dynamic capture (capture/dynamic.py) of this call, cached, and the call's
    result from its runner; or None when the forward cannot be captured
    symbolically (the caller captures it statically, and the bucket's later misses
    too)."""
    first = 1 if self is not None else 0
    # The forward runs on fakes: what it writes into module state (a cache keyed by
    # length) holds fakes.  A capture that fails puts the tree's state back first.
    saved = training.tree_state(self) if isinstance(self, torch.nn.Module) else []
    try:
        symbolic = dynamic.SymbolicInputs(fields, call_key, slots[first:], slot_names[first:])
        if not symbolic.bindings and not symbolic.float_symbols:
            return None   # every chosen size is 0 or 1 in this call: a static capture
        logs.recaptures.info("%s: capturing with %s symbolic", where,
                             ", ".join(symbolic.origins.values()))
        reply = _capture(config, fn, code, self, slots, slot_names, bucket, key, where,
                         caller_depth, symbolic)
        fixed = symbolic.specialised()
        if (len(fixed) == len(symbolic.bindings) and not symbolic.float_symbols
                and not dynamic.passes_kv_cache(slots[first:])):
            # Every symbol was fixed to its value: symbolic captures of this forward
            # would only cost more. This one stands; later ones are static.  (Not for
            # a decoder step: its first cache may hold one token, a size that is
            # always fixed, and the next step's sizes are not.)
            dynamic.failed(bucket)
            logs.recaptures.info("%s: sizes stay static (specialised: %s)", where,
                                 "; ".join(fixed))
        return reply
    except dynamic.Unsupported as exc:
        reason = str(exc)
    except (Warning, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:   # fake tensors refused an op, a data-dependent size...
        if unwinding.interrupt_in(exc) is not None:   # Ctrl-C reaches the caller
            raise
        reason = f"{type(exc).__name__}: {exc}"
    training.restore_tree_state(saved)
    dynamic.failed(bucket)
    logs.recaptures.info("%s: sizes stay static (dynamic capture failed: %s)", where, reason)
    return None


def _capture(config: CompileConfig, fn: Callable[..., Any], code: Any, self: Any, slots: tuple,
             slot_names: tuple, bucket: Any, key: list[str], where: str,
             caller_depth: int, symbolic: Any = None) -> Any:
    """Trace the call, guard and cache the capture; the reply to C.  With `symbolic`
    the trace runs on its fake arguments, and any failure raises
    `dynamic.Unsupported` before anything is cached or returned."""
    first = 1 if self is not None else 0
    arguments = list(zip(slot_names[first:], slots[first:]))
    global_state = state_guards.global_state_guard()
    mutable = state_guards.argument_snapshot(arguments)
    reachable = state_guards.argument_snapshot(state_guards.forward_namespace_values(fn))
    rng = state_guards.python_rng_state()
    traced_slots = _state_aliases_apart(slots, first, self, fn)
    inductor_start.begin_for(config.backend_name, self, slots[first:])
    if symbolic is not None:
        traced_slots = traced_slots[:first] + tuple(
            fake if fake is not real else traced
            for fake, real, traced in zip(symbolic.values, slots[first:], traced_slots[first:]))
    recorder = state_guards.CodeRecorder()

    def recorded() -> Any:
        with recorder, compile_safe_paths():
            return tracer.capture(fn, traced_slots, slot_names, root=self,
                                  fullgraph=config.fullgraph and symbolic is None,
                                  call=slot_call(fn, code, traced_slots, caller_depth),
                                  symbolic=symbolic, rebuild_objects=True)

    # What a garbage collection would run meanwhile is not the forward's: neither
    # recorded nor guarded (tracing/asynchronous.py).
    capture = _C.call_without_collections(recorded)
    # The state walk serves value guards, which only entries with a graph get.
    # Guards describe the state a call starts from: attributes the forward wrote
    # (replayed by the runner) are read as they were before it.
    try:
        with capture.state_before_writes():
            found = (walk_state(capture, self, recorder, fn, arguments)
                     if capture.fallback is None else state_guards.StateGuardSet())
        unsound = _unreplayable(capture, recorder, mutable, found, self, rng, reachable)
    except Exception as exc:
        if unwinding.interrupt_in(exc) is not None:   # Ctrl-C reaches the caller
            raise
        if symbolic is not None:
            raise dynamic.Unsupported(f"guarding failed: {exc!r}") from exc
        return _uncached(config, capture, f"guarding the capture of {where}", exc)
    if symbolic is not None and (unsound is not None or capture.fallback is not None):
        raise dynamic.Unsupported(unsound or str(capture.fallback))
    if unsound is not None and unsound.startswith(_SIDE_EFFECT_ON_ARGUMENT):
        at_fault = _mutated_types_of(mutable, arguments)
        _remember_mutated_types(code, at_fault)
        if at_fault and not config.fullgraph:
            # This call's result stands (the forward ran once, its side effects
            # with it); later calls with such an object run eagerly from C.
            fallback = tracer.Fallback(unsound, *_forward_line(code))
            _make_entry(config, tracer.Capture(None, None, fallback, [], [], [], [],
                                               slot_names), code, self, key, where)
            _add_eager_types(bucket, at_fault, str(fallback))
            bucket.fallbacks += 1
            return capture.result, None
    if unsound is not None:
        if config.fullgraph:
            raise tracer.GraphBreakError(tracer.Fallback(unsound, *_forward_line(code)))
        if capture.fallback is None:
            capture.fallback = tracer.Fallback(unsound, *_forward_line(code))
            capture.graph_module = None
            capture.runner_spec = None
    if capture.fallback is not None:
        # The trace ran the forward for real and fell back: this call's result is
        # eager's, and cache_info() counts it as a call run eagerly (C counts the
        # calls it runs eagerly itself: cached fallbacks, the limit, early ones).
        bucket.fallbacks += 1
    if capture.fallback is not None and (capture.fallback.retry or capture.fallback.reason.startswith(
            (_NOT_CACHED, _NOT_CACHED_RECORD, _NOT_CACHED_HOOKS))):
        # Caching this capture's fallback would send later, ordinary calls with the
        # same key to eager for good: keep nothing, the next call captures again.
        logs.fallbacks.debug("%s not cached: %s", where, capture.fallback)
        return capture.result, None
    reads = ReadContext(global_state, found)

    try:
        with capture.state_before_writes():
            entry = _make_entry(config, capture, code, self, key, where, reads, symbolic)
    except Exception as exc:
        if unwinding.interrupt_in(exc) is not None:   # Ctrl-C reaches the caller
            raise
        if symbolic is not None:
            raise dynamic.Unsupported(f"caching failed: {exc!r}") from exc
        return _uncached(config, capture, f"caching the capture of {where}", exc)
    unchanged = getattr(capture, "state_unchanged", None)
    if unchanged is not None and not unchanged():
        # Another thread changed hooks or the module tree during this capture: the
        # entry's guard versions were taken after the change. Not cached.
        if symbolic is not None:
            raise dynamic.Unsupported("the module tree changed during the capture")
        return capture.result, None
    result = capture.result
    if symbolic is not None:
        # The trace ran on fakes: the call's result is the runner's, on the real
        # arguments (their side effects, BatchNorm statistics say, happen here, once).
        flags = [module.training for module in capture.training_inputs]
        result = entry.runner(*slots, *flags)
    return trace_state.in_flight_reply(bucket, result, entry)


def _uncached(config: CompileConfig, capture: Any, what: str, exc: Exception) -> tuple[Any, Any]:
    """Our own failure after the forward ran: its result stands, nothing is kept (with
    fullgraph=True the error is raised)."""
    if config.fullgraph:
        raise exc
    warn_at_user(f"nnscaler: {what} failed ({exc!r}); this call's result is kept and "
                 "the next call captures again")
    return capture.result, None


_NOT_CACHED = "an input tensor is also"
_NOT_CACHED_RECORD = "the code that ran could not be recorded"
_NOT_CACHED_HOOKS = "not cached until hooks run as nodes:"


def _forward_line(code: Any) -> tuple[str, int]:
    return code.co_filename, code.co_firstlineno


_SIDE_EFFECT_ON_ARGUMENT = "side effect on an argument"
# code -> argument object types this forward was seen to mutate (an HF KV cache filled
# in place): later calls with such an argument fall back before tracing, not after.
_mutated_types: "weakref.WeakKeyDictionary[Any, set[type]]" = weakref.WeakKeyDictionary()


def _mutated_types_of(mutable: Any, arguments: list[tuple[str, Any]]) -> set[type]:
    """The types of the objects keyed by identity in the argument the forward changed
    (an HF cache, not a config object passed beside it)."""
    changed = state_guards.mutated_arguments(mutable)
    if changed is None:
        return set()
    value = dict(arguments)[changed[1]]
    return {type(obj) for obj in state_guards.identity_keyed(value)}


def _remember_mutated_types(code: Any, at_fault: set[type]) -> None:
    if at_fault:
        _mutated_types.setdefault(code, set()).update(at_fault)


def _add_eager_types(bucket: Any, at_fault: set[type], reason: str) -> None:
    """From the next call on, C runs this bucket's calls with an argument of one of
    these types eagerly, before building a key (cache.h, eager_types)."""
    known = [t for t, _ in bucket.eager_types]
    new = tuple((t, reason) for t in at_fault if all(t is not k for k in known))
    if new:
        bucket.eager_types = bucket.eager_types + new


def _mutated_before(code: Any, names: tuple[str, ...],
                    values: tuple[Any, ...]) -> Optional[tuple[Any, type]]:
    known = _mutated_types.get(code)
    if not known:
        return None
    for name, value in zip(names, values):
        for obj in state_guards.identity_keyed(value):
            if type(obj) in known:
                return tracer.Fallback(
                    f"{_SIDE_EFFECT_ON_ARGUMENT}: the forward changed a {type(obj).__name__} "
                    f"passed as {name!r} before (not replayed)", *_forward_line(code)), type(obj)
    return None


def _state_aliases_apart(slots: tuple, first: int, root: Any, fn: Any) -> tuple:
    """The slots to trace with: a tensor argument that is also state the forward can
    read (a parameter or buffer, a tensor attribute of a module of the tree, a global
    or closure tensor its code names: `model(model.position_ids)`, `model(MASK)`) is
    passed as a view of itself.

    The tracer knows values by identity, so the argument and the state tensor would
    be one node, and the graph would hold only while the argument is that very
    tensor.  A view shares storage, version counter and autograd history with it (an
    in-place op on either is seen by both, as in eager), yet is another object: the
    graph then takes the argument as an input and reads the state as state, which is
    right whatever a later call passes.  The view exists for the capture only; later
    calls pass their own tensors.  (State reached otherwise, through a helper's
    globals, is found after the trace: that call is not cached.)"""
    if not any(isinstance(v, torch.Tensor) for v in slots[first:]):
        return slots
    state = {id(t) for _, t in state_guards.forward_namespace_values(fn, tensors=True)
             if isinstance(t, torch.Tensor)}
    if isinstance(root, torch.nn.Module):
        for module in root.modules():
            state.update(id(t) for t in module._parameters.values() if t is not None)
            state.update(id(t) for t in module._buffers.values() if t is not None)
            state.update(id(t) for t in vars(module).values() if isinstance(t, torch.Tensor))
    if not any(isinstance(v, torch.Tensor) and id(v) in state for v in slots[first:]):
        return slots
    with torch._C.DisableTorchFunction():
        return tuple(v.view_as(v) if i >= first and isinstance(v, torch.Tensor) and id(v) in state
                     else v for i, v in enumerate(slots))


def _unreplayable(capture: Any, recorder: Any, mutable: list, found: Any,
                  self: Any, rng: tuple, reachable: list = ()) -> Optional[str]:
    """Why replaying this capture would not do what eager does, or None.

    Side effects on arguments and globals are not part of the graph, and an input
    that is also a parameter, buffer or tensor of module/global state was traced as
    one value (the tracer maps tensors by identity), so the graph cannot tell them
    apart on the next call."""
    if capture.fallback is not None:
        return None
    if not recorder.complete:
        return f"{_NOT_CACHED_RECORD} (out of memory while recording it)"
    now = state_guards.python_rng_state()
    if now != rng:
        if now[0] == rng[0] and len(now) > len(rng):
            # numpy.random was first imported during the capture (torch imports it
            # lazily, torch.cond's first use for one): whether the forward drew from
            # it is unknown, so nothing is kept and the next call, which can compare
            # its state, captures again.
            return f"{_NOT_CACHED_RECORD} (NumPy's random generator appeared during it)"
        return ("the forward drew numbers from Python's or NumPy's global random "
                "generator: a graph would bake them in as constants")
    changed = state_guards.mutated_arguments(mutable)
    if changed is not None:
        return f"{_SIDE_EFFECT_ON_ARGUMENT}: the forward changed {changed[0]}"
    if found.unguardable:
        return f"the forward can read state no guard can compare: {found.unguardable[0]}"
    written = recorder.global_writes()
    if written:
        return f"side effect on globals: the forward wrote global {written[0]!r}"
    changed = state_guards.mutated_arguments(reachable)
    if changed is not None:
        # `log.append(...)` on a global or closure list: not part of the graph, and
        # the guards, taken after the capture, would see nothing change
        return f"side effect on state: the forward changed {changed[0]} (not replayed)"
    state: set[int] = set(found.state_tensors)
    if self is not None:
        state.update(id(t) for t in self.parameters())
        state.update(id(t) for t in self.buffers())
    for module in capture.visited_modules:
        state.update(id(t) for t in module.parameters(recurse=False))
        state.update(id(t) for t in module.buffers(recurse=False))
    for constant in getattr(capture, "unproven_constants", ()):
        if id(constant) not in state:
            followed = hook_nodes.escaped({id(m): m for m in capture.opaque_modules})
            if followed:
                return (f"{_NOT_CACHED_HOOKS} a tensor made inside "
                        f"{', '.join(sorted(set(followed)))}, run opaque for its forward "
                        "hooks, reached the graph as a constant: from the next capture its "
                        "forward is traced and its hooks run as graph nodes")
            return ("a tensor computed outside torch function dispatch reached the "
                    "graph as a constant (a later call would replay this run's value)")
    inputs = capture.example_inputs()
    if not inputs:
        return None
    spec = capture.runner_spec
    if spec is not None:
        state.update(id(v) for v in spec.attr_values.values() if isinstance(v, torch.Tensor))
    for input_value in inputs:
        if isinstance(input_value, torch.Tensor) and id(input_value) in state:
            return (f"{_NOT_CACHED} a parameter, buffer or tensor the forward read from "
                    "state; a graph cannot tell them apart on later calls")
    return None


def _make_entry(config: CompileConfig, capture: Any, code: Any, self: Any, key: list[str],
                where: str, reads: Optional[ReadContext] = None,
                symbolic: Any = None) -> Any:
    if capture.graph_module is not None:
        release_source_with(capture.graph_module)
    folded_flags: list[tuple[Any, bool]] = []
    per_size: Optional[PerSizeCompiled] = None
    shared: list = []
    if capture.fallback is not None:
        logs.fallbacks.debug("%s runs eagerly: %s", where, capture.fallback)
        runner = None
    else:
        runner, folded_flags, per_size, shared = _compile_runner(config, capture, code, where,
                                                                  symbolic is not None)
        runner_code = getattr(runner, "__code__", None)
        if runner_code is not None:
            _C.mark_skip(runner_code)
        if logs.graph.isEnabledFor(10):
            notes = "".join(f"\n  {note}" for note in capture.branch_notes)
            logs.graph.debug("captured %s:%s\n%s", where, notes, capture.graph_module.code)
    # A fallback entry runs the frame eagerly, which is right whatever the state: it
    # needs no value guards (with them, an argument whose state changes every call,
    # such as a KV cache, would retry the capture on every call).
    guards = build_state_guards(capture, self, config.skip_nnmodule_hook_guards, folded_flags,
                                reads if runner is not None else None)
    if logs.guards.isEnabledFor(10):
        logs.guards.debug("guards of %s:\n  key: %s\n  state: %s", where, "; ".join(key),
                          "; ".join(guards.names) or "none")
    info = EntryInfo(where, key, guards.names, capture.graph_module, capture.fallback,
                     config.backend_name, runner, guards.not_guarded,
                     reads.global_state[0] if reads is not None else None,
                     capture.runner_spec.state_writes if capture.runner_spec is not None else ())
    info.branches = list(getattr(capture, "branch_notes", ()))
    if capture.runner_spec is not None:
        info.object_writes = describe_writes(capture.runner_spec.output.writes,
                                             capture.slot_names)
    info.shared_blocks = shared
    if symbolic is not None:
        wild, program, words = symbolic.guard_program()
        info.symbols = symbolic.symbols_in_words()
        info.shape_guards = words
        info.per_size = per_size.refusal if per_size is not None else None
        info.size_buckets = per_size.buckets_note if per_size is not None else ""
    # A capture that ran nothing for real and replays no write can be made again on
    # fake inputs (automatic dynamic, capture/dynamic.py).
    info.symbolic_ok = runner is not None and not capture.runner_spec.state_writes and all(
        node.op != "call_module" and not node.meta.get("nnscaler_opaque")
        for node in capture.graph_module.graph.nodes)
    entry = _C.CacheEntry(runner, capture.training_inputs, guards.flags,
                          guards.names, info, guards.values)
    if symbolic is not None:
        entry.set_shape_guards(wild, program, symbolic.key_len)
    collector = getattr(_local, "collector", None)
    if collector is not None:
        collector.entries.append(info)
    return entry
