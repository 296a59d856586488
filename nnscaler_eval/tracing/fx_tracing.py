"""Finding the torch.fx tracer that should record a call (ifexpr, registered ops)."""
from __future__ import annotations

import sys
from typing import Any, Optional


def _find_proxy(value: Any, proxy_type: type) -> Optional[Any]:
    if isinstance(value, proxy_type):
        return value
    if isinstance(value, (tuple, list)):
        items: Any = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return None
    for item in items:
        found = _find_proxy(item, proxy_type)
        if found is not None:
            return found
    return None


def active_fx_tracer(args: Any, kwargs: Any = None) -> Optional[Any]:
    """The tracer behind an `fx.Proxy` among the arguments (at any depth); else, while
    `torch.fx.symbolic_trace` runs on this thread, the tracer found on the stack (so a
    call with constant arguments still becomes a node); else None."""
    fx = sys.modules.get("torch.fx")
    if fx is None:
        return None
    proxy = _find_proxy(args, fx.Proxy)
    if proxy is None and kwargs:
        proxy = _find_proxy(kwargs, fx.Proxy)
    if proxy is not None:
        return proxy.tracer
    # Here, not at the top: this module imports no torch, and finds torch.fx in use
    # (sys.modules above) before it asks it anything.
    from torch.fx import _symbolic_trace

    # is_fx_symbolic_tracing: False under torch.compile/export, and it does not warn.
    symbolic = getattr(_symbolic_trace, "is_fx_symbolic_tracing", _symbolic_trace.is_fx_tracing)
    if not symbolic():
        return None
    # The flag is process-wide: look for a Tracer.trace frame on *this* thread's stack.
    # Matched by name and `self`, not by code identity: once torch._dynamo is imported,
    # Tracer.trace is a disable-wrapper whose code is shared with every wrapped function.
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "trace":
            tracer = frame.f_locals.get("self")
            if isinstance(tracer, fx.Tracer):
                return tracer
        frame = frame.f_back
    return None
