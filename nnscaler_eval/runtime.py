"""Runtime functions called by rewritten bytecode and by captured graphs.

`ifexpr` is published as `nnscaler.runtime.function.ifexpr`; graphs and exported code
name it by that path.
"""
from __future__ import annotations

from typing import Any, TypeVar

from nnscaler_eval.tracing.fx_tracing import active_fx_tracer
from nnscaler_eval.tracing.trace_state import current_tracer

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
    fx_tracer = active_fx_tracer((cond, true_value, false_value))
    if fx_tracer is not None:
        return fx_tracer.create_proxy("call_function", ifexpr, (cond, true_value, false_value), {})
    return true_value if cond else false_value


ifexpr.__module__ = "nnscaler.runtime.function"


def nnscaler_leaf(target: Any, body: Any, *args: Any, **kwargs: Any) -> Any:
    """nnScaler's runtime function `target` (`fold_constant`), whose own code is `body`,
    called: in an export for nnScaler, one `call_function` node of `target` (nnScaler's
    tracer keeps it as a leaf; its parser acts on it); otherwise `body(...)`."""
    tracer = current_tracer()
    values = getattr(tracer, "python_values", None) if tracer is not None else None
    if values is not None and tracer.recording:
        return values.leaf(target, body, args, kwargs)
    return body(*args, **kwargs)
