"""Process-wide patches that let a trace see what TorchFunctionMode cannot.

`nn.Module.__call__` (submodule calls: hooks, training flags, visited modules),
`nn.Module.__setattr__` (writes to module state), `nn.Module.__init__` (modules the
forward builds, `nn.Softmax(dim=-1)(x)`: made anew by every call), `builtins.print` and
`sys.breakpointhook` (Python side effects a replay would lose), the clocks of `time`
and `os.urandom` (values a graph would bake in as constants), and the C functions
that take a `bool` flag and are called directly, not through a Python wrapper that
dispatches (`_VF.lstm(..., self.training, ...)` in nn.LSTM, `torch.dropout`,
`torch.set_grad_enabled(self.training)`): their argument parser rejects a
`TrainingFlag` (an int) before torch function dispatch could unwrap it.

Also `nn.Module.training`: a data descriptor on the class (it wins over the instance
`__dict__`) through which the tracing thread reads its `TrainingFlag`s; every other
thread, and every `__dict__` reader, sees the real bool (see `_TrainingAttribute`).

They are installed only while at least one thread is tracing (the set of tracing
owners, under a lock) and every wrapper is a plain pass-through on a thread that is not
tracing, so an eager thread running beside a trace behaves exactly as it would
without it.

Interrupts: a KeyboardInterrupt raised by a signal handler can land between any two
bytecodes. The originals are read once, at import, into `_Patch` objects, and later
only from an attribute that does not hold our replacement; each patch goes in and
comes out with one `setattr`, every mix of patched and unpatched attributes is valid,
and `uninstall(owner)` is idempotent and repairs a partial install, so the tracer's
outer `finally` can simply run it again until it completes.
The wrappers call back into the thread's tracer through a small protocol:

    tracer.on_module_call(module, args, kwargs) -> result
    tracer.on_module_setattr(module, name[, value]) (may raise GraphBreakError)
    tracer.on_module_created(module)
    tracer.on_python_side_effect(what)            (may raise GraphBreakError)
    tracer.graph_break(reason)                    (may raise GraphBreakError)
    tracer.call_opaque(function, args, kwargs) -> result
    tracer.call_with_flags(function, args, kwargs) -> result
    tracer.recording                              (False while suspended / fallen back)

Known gap: other C callables with a `bool` parameter (`x.requires_grad_(self.training)`)
still raise TypeError when handed a flag.
"""

from __future__ import annotations

import builtins
import inspect
import os
import sys
import time
import threading
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from nnscaler_eval._C import call_at_depth as _call_at_depth
from nnscaler_eval._C import call_holding as _call_holding
from nnscaler_eval._C import call_with_mode_replaced as _call_with_mode_replaced
from nnscaler_eval._C import recursion_depth as _recursion_depth
from nnscaler_eval.tracing.compile_awareness import dynamo_is_compiling
from nnscaler_eval.tracing.locations import is_library_file
from nnscaler_eval.tracing.trace_state import current_tracer
from nnscaler_eval.tracing.tracked_values import holds_tracked, plain_value, quiet_plain

# The real function, for graphs to call (never the shim installed while tracing).
REAL_SET_GRAD_ENABLED: Callable[[bool], None] = torch._C._set_grad_enabled

_MISSING: Any = object()


class _Patch:
    """One attribute that tracing replaces: `owner.name` -> `replacement`.

    `original` is what the attribute held when this module was imported; `saved` is
    what it held when the patch last went in (the import-time original, or whatever
    another library put there since). Both are read only from an attribute that does
    not hold our replacement, so a patch left behind (an interrupt) is never mistaken
    for an original. Applying and removing are each one `setattr`/`delattr`, idempotent,
    and valid in any combination: an interrupt between two patches leaves some in and
    some out, which is harmless (every replacement is a pass-through on a thread that
    is not tracing) and which the next `uninstall()` repairs.
    """

    __slots__ = ("owner", "name", "replacement", "original", "saved")

    def __init__(self, owner: Any, name: str, replacement: Any) -> None:
        self.owner = owner
        self.name = name
        self.replacement = replacement
        self.original = self._read()
        if self.original is replacement:
            raise RuntimeError(f"nnscaler: {name} is patched at import")
        self.saved = self.original

    def _read(self) -> Any:
        if isinstance(self.owner, type):
            # The class's own attribute, not an inherited one or a descriptor's result.
            return self.owner.__dict__.get(self.name, _MISSING)
        return getattr(self.owner, self.name, _MISSING)

    @property
    def target(self) -> Any:
        """What the replacement forwards to."""
        return self.saved

    def apply(self) -> None:
        current = self._read()
        if current is self.replacement:
            return
        self.saved = current
        setattr(self.owner, self.name, self.replacement)

    def remove(self) -> None:
        if self._read() is not self.replacement:
            return  # never applied, already removed, or replaced by somebody else since
        if self.saved is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.saved)

    @property
    def applied(self) -> bool:
        return self._read() is self.replacement


# Held through _call_holding (csrc/held_lock.h: `with lock:` is not interrupt-safe on
# 3.13+).  Reentrant: a finalizer the GC runs on this thread while it is held may
# end a trace of its own.
_lock = threading.RLock()
# The traces running now (any thread): the patches are in while this is not empty.
_owners: set[int] = set()


def _tracing_tracer() -> Optional[Any]:
    # torch.compile tracing through these patches (eager torch.cond compiles its
    # branches) must see the plain functions: Dynamo cannot inline our tracer.
    if dynamo_is_compiling():
        return None
    tracer = current_tracer()
    if tracer is not None and getattr(tracer, "recording", False):
        return tracer
    return None


class _PassThrough(TorchFunctionMode):
    """What a trace's mode does while the trace is suspended or fell back: each op
    runs with tracked values as plain ones, recording nothing.  Stands in for those
    modes while such a trace calls a module (one instance for every trace, so nested
    opaque calls stack one pass-through, not one per enclosing trace)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        return func(*quiet_plain(args), **quiet_plain(kwargs or {}))


_PASS_THROUGH = _PassThrough()


# Recursion budget: this wrapper stands where eager has nn.Module.__call__, and the
# tracer adds frames of its own before it calls the real one (original_module_call).
# The real one runs at this wrapper's depth, as in eager (csrc/recursion.h): the
# depth is handed over per thread, to the original_module_call of the same module,
# as (id(module), depth): one an interrupt leaves behind holds nothing alive, and is
# never taken (every original_module_call follows a _module_call that set its own).
_call_depth = threading.local()


def _module_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if dynamo_is_compiling():            # Dynamo inlines this: plain Python only
        return _MODULE_CALL.saved(module, *args, **kwargs)
    depth = _recursion_depth() - 1      # the caller's: this frame stands for __call__'s
    tracer = current_tracer()
    if tracer is None:                  # another thread traces: a pass-through
        return _call_at_depth(depth, _MODULE_CALL.saved, module, *args, **kwargs)
    if not getattr(tracer, "recording", False):
        # This thread's trace fell back or is suspended: its mode passes ops through.
        return _call_with_mode_replaced(tracer, _PASS_THROUGH, _call_at_depth, depth,
                                        _MODULE_CALL.saved, module, *args, **kwargs)
    outer = getattr(_call_depth, "pending", None)
    try:
        _call_depth.pending = (id(module), depth)
        return tracer.on_module_call(module, args, kwargs)
    finally:
        _call_depth.pending = outer


def _module_setattr(module: nn.Module, name: str, value: Any) -> None:
    tracer = _tracing_tracer()
    if tracer is not None:
        tracer.on_module_setattr(module, name, value)
    _MODULE_SETATTR.saved(module, name, value)


# ids of the modules whose __init__ runs through _module_init on this thread now
_initialising = threading.local()


def _module_init(module: nn.Module, *args: Any, **kwargs: Any) -> None:
    running = getattr(_initialising, "ids", None)
    if running is None:
        running = _initialising.ids = set()
    if id(module) in running:
        # Ours again for the same module: another library that wraps
        # nn.Module.__init__ (Dynamo's mutation guard does) took this wrapper for the
        # original while it was in, and ours now calls theirs: torch's own ends it.
        _MODULE_INIT.original(module, *args, **kwargs)
        return
    tracer = _tracing_tracer()
    if tracer is not None:
        tracer.on_module_created(module)
    try:
        running.add(id(module))
        _MODULE_INIT.saved(module, *args, **kwargs)
    finally:
        running.discard(id(module))


def _print(*args: Any, **kwargs: Any) -> None:
    tracer = _tracing_tracer()
    # print() called by library code (logging reporting an error of its own, torch)
    # prints as in eager: it is not the model's side effect, and raising inside
    # logging's own error handling would only print more.
    if tracer is not None and not is_library_file(sys._getframe(1).f_code.co_filename):
        tracer.on_python_side_effect(
            "print() (a Python side effect that replaying the graph would lose)"
        )
    _PRINT.saved(*args, **kwargs)


def _breakpointhook(*args: Any, **kwargs: Any) -> Any:
    tracer = _tracing_tracer()
    if tracer is not None:
        tracer.on_python_side_effect("breakpoint()")
    return _BREAKPOINTHOOK.saved(*args, **kwargs)


# Impure C functions whose result a trace would bake into the graph as a constant:
# each call of the forward must see a new value, so a capture whose model code calls
# one falls back. Reached as `time.time()`/`os.urandom()` (a name bound by `from time import
# time` before tracing is not seen; Python's and NumPy's global generators are
# checked by their state instead, see state_guards.python_rng_state).
_IMPURE_FUNCTIONS = (
    (time, ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic",
            "monotonic_ns", "process_time", "process_time_ns", "thread_time",
            "thread_time_ns")),
    (os, ("urandom",)),
)


def _impure_patch(owner: Any, name: str) -> _Patch:
    patch: _Patch
    what = f"{owner.__name__}.{name}() (a new value every call: a graph would bake this one in)"

    def replacement(*args: Any, **kwargs: Any) -> Any:
        tracer = _tracing_tracer()
        if tracer is not None:
            # Only the model's own code: torch, the standard library and this package
            # read clocks for their own bookkeeping (log records, timings, temporary
            # names), which never reaches a tensor.
            if not is_library_file(sys._getframe(1).f_code.co_filename):
                tracer.on_python_side_effect(what)
        return patch.saved(*args, **kwargs)

    replacement.__name__ = name
    patch = _Patch(owner, name, replacement)
    return patch


class _TrainingAttribute:
    """`nn.Module.training` while some thread traces: a data descriptor on the class,
    so it wins over the instance `__dict__`, which keeps the real bool throughout.

    On a thread that is not tracing it reads and writes the `__dict__` entry, exactly
    what plain attribute access does. On the tracing thread it asks the tracer, which
    answers its `TrainingFlag` for the modules it traces (and the plain value for the
    others, and for all of them once it stopped recording). A write tells the tracer
    first (a write to module state; it may raise `GraphBreakError` with fullgraph).
    Nothing foreign is ever stored in a module, so other threads, the C hit path
    (which reads `training` to pass flags to runners) and `module.__dict__` readers
    only ever see bools.
    """

    __slots__ = ()

    def __get__(self, module: Any, owner: Any = None) -> Any:
        if module is None:
            return self
        try:
            value = module.__dict__["training"]
        except KeyError:
            # As without us: nn.Module.__getattr__ then raises its AttributeError.
            raise AttributeError("training") from None
        tracer = current_tracer()
        if tracer is None or dynamo_is_compiling():
            return value
        read = getattr(tracer, "read_training", None)
        return value if read is None else read(module, value)

    def __set__(self, module: Any, value: Any) -> None:
        tracer = _tracing_tracer()
        if tracer is not None:
            tracer.on_module_setattr(module, "training")
        module.__dict__["training"] = value

    def __delete__(self, module: Any) -> None:
        tracer = _tracing_tracer()
        if tracer is not None:
            tracer.on_module_setattr(module, "training")
        try:
            del module.__dict__["training"]
        except KeyError:
            raise AttributeError("training") from None


TRAINING_ATTRIBUTE = _TrainingAttribute()


def training_is_ours(module: nn.Module) -> bool:
    """Does `module.training` resolve to our descriptor (no class of it shadows it)?"""
    for klass in type(module).__mro__:
        if "training" in klass.__dict__:
            return klass.__dict__["training"] is TRAINING_ATTRIBUTE
    return False


# C functions with a `train` / `training` bool that torch.nn or user code calls
# directly: in `torch` and in `torch._VF` (which nn.RNN uses).
_TRAINING_BOOL_FUNCTIONS = (
    "dropout",
    "dropout_",
    "feature_dropout",
    "feature_dropout_",
    "alpha_dropout",
    "alpha_dropout_",
    "feature_alpha_dropout",
    "feature_alpha_dropout_",
    "native_dropout",
    "batch_norm",
    "instance_norm",
    "native_batch_norm",
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
    "rrelu",
    "rrelu_",
)


def _flag_aware(resolve: Callable[[], Callable[..., Any]], name: str) -> Callable[..., Any]:
    """A function calling `resolve()`, accepting training flags for its bool parameters."""

    def call(*args: Any, **kwargs: Any) -> Any:
        function = resolve()
        if not holds_tracked(args, kwargs):
            return function(*args, **kwargs)
        tracer = _tracing_tracer()
        if tracer is not None:
            return tracer.call_with_flags(function, args, kwargs)
        return function(*quiet_plain(args), **quiet_plain(kwargs))

    function = resolve()
    call.__name__ = getattr(function, "__name__", name)
    call.__qualname__ = getattr(function, "__qualname__", call.__name__)
    call.__wrapped__ = function  # type: ignore[attr-defined]
    return call


def _set_grad_enabled(mode: Any) -> None:
    # Grad mode chosen by a flag is a branch on it: specialise, record it.
    _SET_GRAD_ENABLED.saved(plain_value(mode))


_set_grad_enabled.__wrapped__ = REAL_SET_GRAD_ENABLED  # type: ignore[attr-defined]
# What torch._C._set_grad_enabled is while a trace runs (capture/calls.py).
PATCHED_SET_GRAD_ENABLED: Callable[[Any], None] = _set_grad_enabled


# autograd.Function.apply: one opaque node, so the custom backward survives replay
# (inlined, its forward's ops would replay under no_grad with no backward at all).
# Looked up statically along the MRO: another tracer (nnScaler's) may have patched it
# on the class and moved the original.
_original_function_apply: Any = inspect.getattr_static(torch.autograd.Function, "apply")
_apply_targets: "weakref.WeakKeyDictionary[type, Callable[..., Any]]" = weakref.WeakKeyDictionary()


def function_apply_target(cls: type) -> Callable[..., Any]:
    """A plain function that runs `cls.apply` (the unpatched one): the graph's target.

    A function of the user's module, not a bound classmethod: fx writes anything
    "from torch" by its qualified name, which would name the base class's apply.
    """
    target = _apply_targets.get(cls)
    if target is None:
        bound = _original_function_apply.__get__(None, cls)

        def apply(*args: Any, **kwargs: Any) -> Any:
            return bound(*args, **kwargs)

        apply.__module__ = cls.__module__
        apply.__qualname__ = f"{cls.__qualname__}.apply"
        apply.__autograd_function__ = cls  # type: ignore[attr-defined]
        _apply_targets[cls] = target = apply
    return target


# torch.cond: eager torch.cond with a tensor predicate runs torch.compile, which must
# not meet the tracer's TorchFunctionMode; the tracer decides what to do with it.
_original_cond: Any = getattr(torch, "cond", None)


def _cond(
    pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any], operands: Any = ()
) -> Any:
    tracer = current_tracer()
    cond = _COND.saved if _COND is not None else _original_cond
    if tracer is None or not hasattr(tracer, "trace_cond"):
        return cond(pred, true_fn, false_fn, operands)
    return tracer.trace_cond(cond, pred, true_fn, false_fn, operands)


# An explicit while_loop (torch._higher_order_ops.while_loop): torch's implementation
# hands the loop to torch.compile through _hop_compile_and_call, which must not run under
# the tracer (Dynamo fails on the tracer's frames); the tracer makes it one node
# (capture/loops.py).  Patched where it is looked up at each call, so that every way of
# importing while_loop reaches it.
_hop_utils: Any = sys.modules.get("torch._higher_order_ops.utils")
_original_hop_compile_and_call: Any = getattr(_hop_utils, "_hop_compile_and_call", None)


def _hop_compile_and_call(fn: Any, args: Any, kwargs: Any = None) -> Any:
    tracer = current_tracer()
    call = _HOP_CALL.saved if _HOP_CALL is not None else _original_hop_compile_and_call
    if tracer is None or not hasattr(tracer, "trace_while_loop") or kwargs \
            or getattr(fn, "__name__", "") != "_while_loop_op_wrapper" or len(args) != 4:
        return call(fn, args, kwargs)
    return tracer.trace_while_loop(call, fn, tuple(args))


# TorchScript runs its ops in C++, out of the TorchFunctionMode's sight: a script
# function called from traced code is one opaque node; a script method called
# directly (not through its module's __call__) is a fallback.
_ScriptFunction: Any = torch.jit.ScriptFunction
_ScriptMethod: Any = torch._C.ScriptMethod
_original_script_function_call: Any = _ScriptFunction.__call__
_original_script_method_call: Any = _ScriptMethod.__call__
_script_targets: dict[int, tuple[Any, Callable[..., Any]]] = {}


def script_function_target(function: Any) -> Callable[..., Any]:
    """A plain function running the script `function`: the graph's target (kept for
    as long as the process, like the script function itself usually is)."""
    entry = _script_targets.get(id(function))
    if entry is None or entry[0] is not function:
        call = _original_script_function_call

        def script(*args: Any, **kwargs: Any) -> Any:
            return call(function, *args, **kwargs)

        script.__module__ = "nnscaler_eval.torchscript"
        script.__qualname__ = script.__name__ = getattr(function, "name", "script_function")
        entry = _script_targets[id(function)] = (function, script)
    return entry[1]


def _script_function_call(function: Any, *args: Any, **kwargs: Any) -> Any:
    tracer = _tracing_tracer()
    if tracer is None:
        return _SCRIPT_FUNCTION_CALL.saved(function, *args, **kwargs)
    return tracer.call_opaque(script_function_target(function), args, kwargs)


def _script_method_call(method: Any, *args: Any, **kwargs: Any) -> Any:
    tracer = _tracing_tracer()
    if tracer is not None:
        tracer.graph_break(f"a TorchScript method ({getattr(method, 'name', '?')}) called directly")
    return _SCRIPT_METHOD_CALL.saved(method, *args, **kwargs)


def _function_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    tracer = _tracing_tracer()
    if tracer is None:
        return _FUNCTION_APPLY.saved.__get__(None, cls)(*args, **kwargs)
    return tracer.call_opaque(function_apply_target(cls), args, kwargs)


class _FlagAwareVariableFunctions:
    """Stands in for `torch._VF.vf` while tracing: the functions above, wrapped."""

    def __init__(self, resolve: Callable[[], Any]) -> None:
        self._resolve = resolve
        functions = resolve()
        self._wrapped = {
            name: _flag_aware(lambda name=name: getattr(resolve(), name), name)
            for name in _TRAINING_BOOL_FUNCTIONS
            if hasattr(functions, name)
        }

    def __getattr__(self, name: str) -> Any:
        wrapped = self._wrapped.get(name)
        return wrapped if wrapped is not None else getattr(self._resolve(), name)


# Every patch, made once, at import: the originals are read here and never again from
# an attribute holding one of our replacements.
_MODULE_CALL = _Patch(nn.Module, "__call__", _module_call)
_MODULE_SETATTR = _Patch(nn.Module, "__setattr__", _module_setattr)
_MODULE_INIT = _Patch(nn.Module, "__init__", _module_init)
_PRINT = _Patch(builtins, "print", _print)
_BREAKPOINTHOOK = _Patch(sys, "breakpointhook", _breakpointhook)
_SET_GRAD_ENABLED = _Patch(torch._C, "_set_grad_enabled", _set_grad_enabled)
_FUNCTION_APPLY = _Patch(torch.autograd.Function, "apply", classmethod(_function_apply))
_SCRIPT_FUNCTION_CALL = _Patch(_ScriptFunction, "__call__", _script_function_call)
_SCRIPT_METHOD_CALL = _Patch(_ScriptMethod, "__call__", _script_method_call)
_COND: Optional[_Patch] = _Patch(torch, "cond", _cond) if _original_cond is not None else None
_HOP_CALL: Optional[_Patch] = (_Patch(_hop_utils, "_hop_compile_and_call", _hop_compile_and_call)
                               if _original_hop_compile_and_call is not None else None)
_TRAINING = _Patch(nn.Module, "training", TRAINING_ATTRIBUTE)


def _torch_function_patch(name: str) -> _Patch:
    patch: _Patch

    def resolve() -> Callable[..., Any]:
        return patch.saved

    patch = _Patch.__new__(_Patch)
    patch.owner, patch.name = torch, name
    patch.original = patch.saved = getattr(torch, name)
    patch.replacement = _flag_aware(resolve, name)
    return patch


_TORCH_FUNCTIONS = [_torch_function_patch(n) for n in _TRAINING_BOOL_FUNCTIONS if hasattr(torch, n)]
_IMPURE = [_impure_patch(owner, n) for owner, names in _IMPURE_FUNCTIONS for n in names
           if hasattr(owner, n)]
_VF_PATCH: Optional[_Patch] = None
_vf_module = sys.modules.get("torch._VF")  # imported by torch.nn (nn.RNN uses it)
if _vf_module is not None and hasattr(_vf_module, "vf"):
    _VF_PATCH = _Patch.__new__(_Patch)
    _VF_PATCH.owner, _VF_PATCH.name = _vf_module, "vf"
    _VF_PATCH.original = _VF_PATCH.saved = _vf_module.vf  # type: ignore[attr-defined]
    _VF_PATCH.replacement = _FlagAwareVariableFunctions(lambda: _VF_PATCH.saved)  # type: ignore[union-attr]

# Order matters for interrupts only in that every prefix is a valid state; removal
# runs in reverse so that the descriptor, the last in, is the first out.
_PATCHES: tuple[_Patch, ...] = tuple(
    p
    for p in (
        _MODULE_CALL,
        _MODULE_SETATTR,
        _MODULE_INIT,
        _PRINT,
        _BREAKPOINTHOOK,
        _SET_GRAD_ENABLED,
        _FUNCTION_APPLY,
        _SCRIPT_FUNCTION_CALL,
        _SCRIPT_METHOD_CALL,
        _COND,
        _HOP_CALL,
        *_TORCH_FUNCTIONS,
        *_IMPURE,
        _VF_PATCH,
        _TRAINING,
    )
    if p is not None
)


def original_module_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`nn.Module.__call__` as it was before tracing patched it; called for the module
    `_module_call` is handling, at that call's recursion depth (once)."""
    pending = getattr(_call_depth, "pending", None)
    if pending is None or pending[0] != id(module):
        return _MODULE_CALL.saved(module, *args, **kwargs)
    _call_depth.pending = None
    tracer = current_tracer()
    if tracer is not None and not getattr(tracer, "recording", False):   # suspended
        return _call_with_mode_replaced(tracer, _PASS_THROUGH, _call_at_depth, pending[1],
                                        _MODULE_CALL.saved, module, *args, **kwargs)
    return _call_at_depth(pending[1], _MODULE_CALL.saved, module, *args, **kwargs)


def original_forward_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`module.forward(...)` in place of `nn.Module.__call__` (whose hooks the caller
    runs itself: capture/hook_nodes.py), at that call's recursion depth."""
    pending = getattr(_call_depth, "pending", None)
    forward = module.forward
    if pending is None or pending[0] != id(module):
        return forward(*args, **kwargs)
    _call_depth.pending = None
    return _call_at_depth(pending[1], forward, *args, **kwargs)


def install(owner: Any) -> None:
    """`owner` (a tracer) enters its trace: the patches go in with the first owner.

    Safe against an asynchronous exception (KeyboardInterrupt) landing anywhere: the
    owner is registered before any patch goes in, so `uninstall(owner)`, which the
    caller runs in a `finally` whether or not this returned, always repairs.
    """
    _call_holding(_lock, _install_locked, owner)


def _install_locked(owner: Any) -> None:
    _owners.add(id(owner))
    for patch in _PATCHES:
        patch.apply()


def uninstall(owner: Any) -> None:
    """`owner` leaves its trace: the patches go out after the last owner.

    Idempotent: call it again after an interrupt landed inside it. A patched attribute
    somebody replaced while we were tracing is left as they set it (our wrapper is a
    pass-through on other threads, so leaving it in their chain is safe).

    The owner goes first, inline and without the lock (one set operation, atomic
    under the GIL): a nested trace leaving on a RecursionError has only the few
    frames of headroom its unwinding gave back, and an extra call here failed there
    (3.13: the trace stayed registered for good).  Only the last owner out takes the
    lock, and looks again under it: an install in between keeps the patches.
    """
    _owners.discard(id(owner))
    if not _owners:
        _call_holding(_lock, _remove_if_idle)


def _remove_if_idle() -> None:
    if not _owners:
        for patch in reversed(_PATCHES):
            patch.remove()


def patched() -> list[str]:
    """The attributes holding one of our replacements now (for tests, diagnostics)."""
    return [f"{getattr(p.owner, '__name__', p.owner)}.{p.name}" for p in _PATCHES if p.applied]


def active_traces() -> int:
    """How many traces are running now, on all threads (for tests and diagnostics)."""
    return len(_owners)
