"""Process-wide patches that let a trace see what TorchFunctionMode cannot.

`nn.Module.__call__` (submodule calls: hooks, training flags, visited modules),
`nn.Module.__setattr__` (writes to module state), `builtins.print` and
`sys.breakpointhook` (Python side effects a replay would lose).

They are installed only while at least one thread is tracing (reference counted under
a lock) and every wrapper is a plain pass-through on a thread that is not tracing, so
an eager thread running beside a trace behaves exactly as it would without it.
The wrappers call back into the thread's tracer through a small protocol:

    tracer.on_module_call(module, args, kwargs) -> result
    tracer.on_module_setattr(module, name)        (may raise GraphBreakError)
    tracer.on_python_side_effect(what)            (may raise GraphBreakError)
    tracer.recording                              (False while suspended / fallen back)
"""
from __future__ import annotations

import builtins
import sys
import threading
from typing import Any, Callable, Optional

import torch.nn as nn

from nnscaler_eval.trace_state import current_tracer

_lock = threading.Lock()
_active_traces = 0

# The originals, saved when the patches go in; the wrappers call these.
_original_module_call: Callable[..., Any] = nn.Module.__call__
_original_module_setattr: Callable[..., None] = nn.Module.__setattr__
_original_print: Callable[..., None] = builtins.print
_original_breakpointhook: Callable[..., Any] = sys.breakpointhook


def _tracing_tracer() -> Optional[Any]:
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
        tracer.on_python_side_effect("print() (a Python side effect that replaying the graph would lose)")
    _original_print(*args, **kwargs)


def _breakpointhook(*args: Any, **kwargs: Any) -> Any:
    tracer = _tracing_tracer()
    if tracer is not None:
        tracer.on_python_side_effect("breakpoint()")
    return _original_breakpointhook(*args, **kwargs)


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
            nn.Module.__setattr__ = _module_setattr  # type: ignore[method-assign]
            builtins.print = _print
            sys.breakpointhook = _breakpointhook
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
            nn.Module.__setattr__ = _original_module_setattr  # type: ignore[method-assign]
        if builtins.print is _print:
            builtins.print = _original_print
        if sys.breakpointhook is _breakpointhook:
            sys.breakpointhook = _original_breakpointhook


def active_traces() -> int:
    """How many traces are running now, on all threads (for tests and diagnostics)."""
    return _active_traces
