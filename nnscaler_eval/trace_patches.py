"""Process-wide patches that let a trace see what TorchFunctionMode cannot.

`nn.Module.__call__` (submodule calls: hooks, training flags, visited modules),
`nn.Module.__setattr__` (writes to module state), `builtins.print` and
`sys.breakpointhook` (Python side effects a replay would lose), and the C functions
that take a `bool` flag and are called directly, not through a Python wrapper that
dispatches (`_VF.lstm(..., self.training, ...)` in nn.LSTM, `torch.dropout`,
`torch.set_grad_enabled(self.training)`): their argument parser rejects a
`TrainingFlag` (an int) before torch function dispatch could unwrap it.

They are installed only while at least one thread is tracing (reference counted under
a lock) and every wrapper is a plain pass-through on a thread that is not tracing, so
an eager thread running beside a trace behaves exactly as it would without it.
The wrappers call back into the thread's tracer through a small protocol:

    tracer.on_module_call(module, args, kwargs) -> result
    tracer.on_module_setattr(module, name)        (may raise GraphBreakError)
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
import sys
import threading
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from nnscaler_eval.compile_awareness import dynamo_is_compiling
from nnscaler_eval.trace_state import current_tracer
from nnscaler_eval.tracked_values import holds_tracked, plain_value, quiet_plain

# The real function, for graphs to call (never the shim installed while tracing).
REAL_SET_GRAD_ENABLED: Callable[[bool], None] = torch._C._set_grad_enabled

_lock = threading.Lock()
_active_traces = 0

# The originals, saved when the patches go in; the wrappers call these.
_original_module_call: Callable[..., Any] = nn.Module.__call__
_original_module_setattr: Callable[..., None] = nn.Module.__setattr__
_original_print: Callable[..., None] = builtins.print
_original_breakpointhook: Callable[..., Any] = sys.breakpointhook


def _tracing_tracer() -> Optional[Any]:
    # torch.compile tracing through these patches (eager torch.cond compiles its
    # branches) must see the plain functions: Dynamo cannot inline our tracer.
    if dynamo_is_compiling():
        return None
    tracer = current_tracer()
    if tracer is not None and getattr(tracer, "recording", False):
        return tracer
    return None


def _module_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    tracer = _tracing_tracer()
    if tracer is None:
        return _original_module_call(module, *args, **kwargs)
    return tracer.on_module_call(module, args, kwargs)


def _module_setattr(module: nn.Module, name: str, value: Any) -> None:
    tracer = _tracing_tracer()
    if tracer is not None:
        tracer.on_module_setattr(module, name)
    _original_module_setattr(module, name, value)


def _print(*args: Any, **kwargs: Any) -> None:
    tracer = _tracing_tracer()
    if tracer is not None:
        tracer.on_python_side_effect(
            "print() (a Python side effect that replaying the graph would lose)"
        )
    _original_print(*args, **kwargs)


def _breakpointhook(*args: Any, **kwargs: Any) -> Any:
    tracer = _tracing_tracer()
    if tracer is not None:
        tracer.on_python_side_effect("breakpoint()")
    return _original_breakpointhook(*args, **kwargs)


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


def _flag_aware(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, accepting training flags for its bool parameters."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if not holds_tracked(args, kwargs):
            return function(*args, **kwargs)
        tracer = _tracing_tracer()
        if tracer is not None:
            return tracer.call_with_flags(function, args, kwargs)
        return function(*quiet_plain(args), **quiet_plain(kwargs))

    call.__name__ = getattr(function, "__name__", "call")
    call.__qualname__ = getattr(function, "__qualname__", call.__name__)
    call.__wrapped__ = function  # type: ignore[attr-defined]
    return call


def _set_grad_enabled(mode: Any) -> None:
    # Grad mode chosen by a flag is a branch on it: specialise, record it.
    _original_set_grad_enabled(plain_value(mode))


_set_grad_enabled.__wrapped__ = REAL_SET_GRAD_ENABLED  # type: ignore[attr-defined]


# autograd.Function.apply: one opaque node, so the custom backward survives replay
# (inlined, its forward's ops would replay under no_grad with no backward at all).
_original_function_apply: Any = torch.autograd.Function.__dict__["apply"]
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
        _apply_targets[cls] = target = apply
    return target


# torch.cond: eager torch.cond with a tensor predicate runs torch.compile, which must
# not meet the tracer's TorchFunctionMode; the tracer decides what to do with it.
_original_cond: Any = getattr(torch, "cond", None)


def _cond(
    pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any], operands: Any = ()
) -> Any:
    tracer = current_tracer()
    if tracer is None or not hasattr(tracer, "trace_cond"):
        return _original_cond(pred, true_fn, false_fn, operands)
    return tracer.trace_cond(_original_cond, pred, true_fn, false_fn, operands)


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
        return _original_script_function_call(function, *args, **kwargs)
    return tracer.call_opaque(script_function_target(function), args, kwargs)


def _script_method_call(method: Any, *args: Any, **kwargs: Any) -> Any:
    tracer = _tracing_tracer()
    if tracer is not None:
        tracer.graph_break(f"a TorchScript method ({getattr(method, 'name', '?')}) called directly")
    return _original_script_method_call(method, *args, **kwargs)


def _function_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    tracer = _tracing_tracer()
    if tracer is None:
        return _original_function_apply.__get__(None, cls)(*args, **kwargs)
    return tracer.call_opaque(function_apply_target(cls), args, kwargs)


class _FlagAwareVariableFunctions:
    """Stands in for `torch._VF.vf` while tracing: the functions above, wrapped."""

    def __init__(self, functions: Any) -> None:
        self._functions = functions
        self._wrapped = {
            name: _flag_aware(getattr(functions, name))
            for name in _TRAINING_BOOL_FUNCTIONS
            if hasattr(functions, name)
        }

    def __getattr__(self, name: str) -> Any:
        wrapped = self._wrapped.get(name)
        return wrapped if wrapped is not None else getattr(self._functions, name)


_original_set_grad_enabled: Callable[[bool], None] = REAL_SET_GRAD_ENABLED
_original_torch_functions: dict[str, Any] = {}
_flag_aware_torch_functions: dict[str, Any] = {}
_original_vf: Any = None
_flag_aware_vf: Optional[_FlagAwareVariableFunctions] = None


def _install_flag_shims() -> None:
    global _original_set_grad_enabled, _original_vf, _flag_aware_vf, _original_function_apply
    _original_set_grad_enabled = torch._C._set_grad_enabled
    torch._C._set_grad_enabled = _set_grad_enabled  # type: ignore[assignment]
    _original_function_apply = torch.autograd.Function.__dict__["apply"]
    torch.autograd.Function.apply = classmethod(_function_apply)  # type: ignore[method-assign,assignment]
    global _original_script_function_call, _original_script_method_call
    _original_script_function_call = _ScriptFunction.__call__
    _original_script_method_call = _ScriptMethod.__call__
    _ScriptFunction.__call__ = _script_function_call
    _ScriptMethod.__call__ = _script_method_call
    global _original_cond
    if getattr(torch, "cond", None) is not None:
        _original_cond = torch.cond
        torch.cond = _cond
    for name in _TRAINING_BOOL_FUNCTIONS:
        original = getattr(torch, name, None)
        if original is not None:
            _original_torch_functions[name] = original
            _flag_aware_torch_functions[name] = _flag_aware(original)
            setattr(torch, name, _flag_aware_torch_functions[name])
    vf_module = sys.modules.get("torch._VF")
    if vf_module is not None and hasattr(vf_module, "vf"):
        _original_vf = vf_module.vf  # type: ignore[attr-defined]
        _flag_aware_vf = _FlagAwareVariableFunctions(_original_vf)
        vf_module.vf = _flag_aware_vf  # type: ignore[attr-defined]


def _uninstall_flag_shims() -> None:
    global _original_vf, _flag_aware_vf
    if torch._C._set_grad_enabled is _set_grad_enabled:
        torch._C._set_grad_enabled = _original_set_grad_enabled  # type: ignore[assignment]
    if getattr(torch, "cond", None) is _cond:
        torch.cond = _original_cond
    if _ScriptFunction.__call__ is _script_function_call:
        _ScriptFunction.__call__ = _original_script_function_call
    if _ScriptMethod.__call__ is _script_method_call:
        _ScriptMethod.__call__ = _original_script_method_call
    apply = torch.autograd.Function.__dict__["apply"]
    if isinstance(apply, classmethod) and apply.__func__ is _function_apply:
        torch.autograd.Function.apply = _original_function_apply  # type: ignore[method-assign]
    for name, original in _original_torch_functions.items():
        if getattr(torch, name, None) is _flag_aware_torch_functions.get(name):
            setattr(torch, name, original)
    _original_torch_functions.clear()
    _flag_aware_torch_functions.clear()
    vf_module = sys.modules.get("torch._VF")
    if (
        vf_module is not None
        and _flag_aware_vf is not None
        and getattr(vf_module, "vf", None) is _flag_aware_vf
    ):
        vf_module.vf = _original_vf  # type: ignore[attr-defined]
    _original_vf = _flag_aware_vf = None


def original_module_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`nn.Module.__call__` as it was before tracing patched it."""
    return _original_module_call(module, *args, **kwargs)


def install() -> None:
    """Enter one trace: patch on the first."""
    global _active_traces, _original_module_call, _original_module_setattr
    global _original_print, _original_breakpointhook
    with _lock:
        if _active_traces == 0:
            _original_module_call = nn.Module.__call__
            _original_module_setattr = nn.Module.__setattr__
            _original_print = builtins.print
            _original_breakpointhook = sys.breakpointhook
            nn.Module.__call__ = _module_call  # type: ignore[method-assign]
            nn.Module.__setattr__ = _module_setattr  # type: ignore[method-assign,assignment]
            builtins.print = _print
            sys.breakpointhook = _breakpointhook
            _install_flag_shims()
        _active_traces += 1


def uninstall() -> None:
    """Leave one trace: unpatch after the last.

    A patch that somebody replaced while we were tracing is left as they set it (our
    wrapper is a pass-through on other threads, so leaving it in their chain is safe).
    """
    global _active_traces
    with _lock:
        _active_traces -= 1
        if _active_traces > 0:
            return
        if nn.Module.__call__ is _module_call:
            nn.Module.__call__ = _original_module_call  # type: ignore[method-assign]
        if nn.Module.__setattr__ is _module_setattr:
            nn.Module.__setattr__ = _original_module_setattr  # type: ignore[method-assign,assignment]
        if builtins.print is _print:
            builtins.print = _original_print
        if sys.breakpointhook is _breakpointhook:
            sys.breakpointhook = _original_breakpointhook
        _uninstall_flag_shims()


def active_traces() -> int:
    """How many traces are running now, on all threads (for tests and diagnostics)."""
    return _active_traces
