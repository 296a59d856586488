"""Runtime functions called by rewritten bytecode and by captured graphs.

`ifexpr` is published as `nnscaler.runtime.function.ifexpr`; graphs and exported code
name it by that path.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Optional, TypeVar

from nnscaler_eval.trace_state import current_tracer

T = TypeVar("T")
F = TypeVar("F")


def ifexpr(cond: Any, true_value: T, false_value: F) -> "T | F":
    """`true_value if cond else false_value`, with both branches already evaluated.

    Rewritten code calls this in place of `a if self.training else b`. Under a capture
    tracer it records one `ifexpr` node whose condition is the module's training flag;
    under `torch.fx.symbolic_trace` it records a `call_function` node.
    """
    tracer = current_tracer()
    if tracer is not None:
        return tracer.trace_ifexpr(cond, true_value, false_value)
    fx_tracer = _fx_tracer_for(cond, true_value, false_value)
    if fx_tracer is not None:
        return fx_tracer.create_proxy("call_function", ifexpr, (cond, true_value, false_value), {})
    return true_value if cond else false_value


ifexpr.__module__ = "nnscaler.runtime.function"


def _fx_tracer_for(*values: Any) -> Optional[Any]:
    """The torch.fx tracer to record into: the one behind a Proxy argument, or, while
    `symbolic_trace` runs, the tracer found on the stack (constant branches still
    become a node, as nnScaler's graphs expect)."""
    fx = sys.modules.get("torch.fx")
    if fx is None:
        return None
    for value in values:
        if isinstance(value, fx.Proxy):
            return value.tracer
    from torch.fx import _symbolic_trace

    # is_fx_tracing() warns on torch 2.13 (it is also true under torch.export)
    is_tracing = getattr(_symbolic_trace, "is_fx_symbolic_tracing", _symbolic_trace.is_fx_tracing)
    if not is_tracing():
        return None
    # inspect.unwrap: once Dynamo has run (eager torch.cond does), Tracer.trace is
    # a `torch._disable_dynamo` wrapper around the real method.
    trace_code = inspect.unwrap(fx.Tracer.trace).__code__
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is trace_code:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None
