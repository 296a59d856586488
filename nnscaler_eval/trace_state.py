"""Which capture tracer, if any, is recording on this thread.

Functions that must show up as single graph nodes (`ifexpr`, ops registered with
`register_op`, submodules with hooks) ask `current_tracer()` and hand themselves to it.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

_local = threading.local()


def current_tracer() -> Optional[Any]:
    """The tracer recording on this thread, or None."""
    return getattr(_local, "tracer", None)


def set_current_tracer(tracer: Optional[Any]) -> Optional[Any]:
    """Install `tracer` for this thread; returns the previous one (to restore)."""
    previous = getattr(_local, "tracer", None)
    _local.tracer = tracer
    return previous
