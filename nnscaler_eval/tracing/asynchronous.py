"""Python that runs in the middle of a capture without the forward calling it runs as
written: a signal handler delivered at one of the tracer's points (signals.py), and
what a garbage collection runs (`gc.callbacks`, the finalizers and weakref callbacks
of cyclic garbage) while the side of an `if` that eager does not take is traced.

Left alone, such code would run as the forward's own: its torch calls recorded into
the graph, its functions noted for value guards, its frames given the capture's
flavour (`if`s hooked) or, inside a side, the checked flavour (capture/checked.py),
which refuses a write to outside state: a finalizer's counter, a handler's stop flag,
lost, and the side refused for what was not its doing.

`plain()` / `resume()` bracket a delivered handler: the capture-code mode 0 (frames run
as written), function recording paused, and the thread's tracer suspended (its torch
function mode passes calls through).  A collection is not bracketed (a gc callback of
ours would run wherever a collection starts, at the recursion limit too, where it fails
and leaves its bracket open): no collection runs while a side runs as checked code
(`checked_begin` / `checked_end`).  Outside the sides, a collection during a capture
still runs its callbacks as the forward's code (their reads guarded: a recapture at
worst).
"""
from __future__ import annotations

import gc
from typing import Any

from nnscaler_eval import _C
from nnscaler_eval.tracing.trace_state import current_tracer


def plain() -> tuple[Any, int, Any]:
    """Enter; returns what `resume()` needs."""
    tracer = current_tracer()
    mode = _C.capture_code_mode(0)
    paused = _C.record_functions_pause()
    if tracer is not None:
        tracer._suspended += 1
    return tracer, mode, paused


def resume(saved: tuple[Any, int, Any]) -> None:
    tracer, mode, paused = saved
    if tracer is not None:
        tracer._suspended -= 1
    _C.record_functions_resume(paused)
    _C.capture_code_mode(mode)


def checked_begin() -> tuple[int, bool]:
    """A side of an `if` starts running as checked code: frames it starts get the
    checked flavour (capture-code mode 2), and no garbage collection runs meanwhile,
    so no gc callback or finalizer runs as checked code (its write to outside state
    refused and lost).  The collections wait for the side's end, a short run on fakes.
    Returns what `checked_end` needs."""
    collecting = gc.isenabled()
    gc.disable()
    return _C.capture_code_mode(2), collecting


def checked_end(saved: tuple[int, bool]) -> None:
    mode, collecting = saved
    _C.capture_code_mode(mode)
    if collecting:
        gc.enable()
