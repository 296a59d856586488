"""Python that runs in the middle of a capture without the forward calling it runs as
written: a signal handler delivered at one of the tracer's points (signals.py), and
what a garbage collection runs (`gc.callbacks`, the finalizers and weakref callbacks
of cyclic garbage).

Left alone, such code would run as the forward's own: its torch calls recorded into
the graph, its functions noted for value guards, its frames given the capture's
flavour (`if`s hooked) or, while the side of an `if` that eager does not take is
traced on fakes, the checked flavour (capture/checked.py), which refuses a write to
outside state: a finalizer's counter, a handler's stop flag, lost, and the side
refused for what was not its doing.

`plain()` / `resume()` bracket such code on the thread that runs it: the capture-code
mode 0 (frames run as written), function recording paused, and the thread's tracer
suspended (its torch function mode passes calls through).  A collection is bracketed
by two `gc.callbacks`, installed while a capture records (its trace, and the
recording of the functions it ran, guarding/state_guards.py): one first in the list (its
"start"), one last (its "stop"), so that the user's callbacks run inside too.
Collections on other threads run there, where no capture mode is set.
"""
from __future__ import annotations

import gc
import threading
from typing import Any, Optional

from nnscaler_eval import _C
from nnscaler_eval.tracing.trace_state import current_tracer

_local = threading.local()
_owners: set[int] = set()   # the traces running (any thread): the brackets stay while any does
_lock = threading.Lock()


def plain() -> tuple[Any, int, Any]:
    """Enter; returns what `resume()` needs."""
    tracer = current_tracer()
    mode = _C.capture_code_mode(0)
    paused = _C.record_functions_pause()
    if tracer is not None:
        tracer._suspended += 1
    return tracer, mode, paused


def resume(saved: Optional[tuple[Any, int, Any]]) -> None:
    if saved is None:   # (a collection whose start came before the brackets)
        return
    tracer, mode, paused = saved
    if tracer is not None:
        tracer._suspended -= 1
    _C.record_functions_resume(paused)
    _C.capture_code_mode(mode)


def _collection_starts(phase: str, info: Any) -> None:
    if phase == "start":
        # (A stop never seen, our callbacks removed meanwhile: put that bracket's
        # state back before opening this one.)
        resume(getattr(_local, "saved", None))
        _local.saved = plain()


def _collection_stops(phase: str, info: Any) -> None:
    if phase == "stop":
        saved, _local.saved = getattr(_local, "saved", None), None
        resume(saved)


def install(owner: Any) -> None:
    """A trace (`owner`) starts: collections are bracketed until every owner has
    called `uninstall`.  Both idempotent per owner (an interrupt may repeat them).
    The lock is held through C (`with lock:` is not interrupt-safe on 3.13+)."""
    _C.call_holding(_lock, _install, id(owner))


def uninstall(owner: Any) -> None:
    _C.call_holding(_lock, _uninstall, id(owner))


def _install(owner: int) -> None:
    if not _owners:
        gc.callbacks.insert(0, _collection_starts)
        gc.callbacks.append(_collection_stops)
    _owners.add(owner)


def _uninstall(owner: int) -> None:
    _owners.discard(owner)
    if not _owners:
        for callback in (_collection_starts, _collection_stops):
            while callback in gc.callbacks:
                gc.callbacks.remove(callback)
