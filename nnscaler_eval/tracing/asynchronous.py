"""Python that runs in the middle of a capture without the forward calling it runs as
written: a signal handler delivered at one of the tracer's points (signals.py), and
what a garbage collection runs (`gc.callbacks`, the finalizers and weakref callbacks
of cyclic garbage).

Left alone, such code would run as the forward's own: its torch calls recorded into
the graph, its functions noted for value guards, its frames given the capture's
flavour (`if`s hooked) or, inside a side, the checked flavour (capture/checked.py),
which refuses a write to outside state: a finalizer's counter, a handler's stop flag,
lost, and the side refused for what was not its doing.

`plain()` / `resume()` bracket a delivered handler: the capture-code mode 0 (frames run
as written), function recording paused, and the thread's tracer suspended (its torch
function mode passes calls through).  A collection is not bracketed (a gc callback of
ours would run wherever a collection starts, at the recursion limit too, where it fails
and leaves its bracket open): no collection runs during a capture's run at all
(`_C.call_without_collections`, csrc/paused_collections.h: around the forward's run
in `Tracer.run`, and around convert_frame's code recorder and capture, so a
finalizer's names are no value guards either).  A finalizer that a collection ran in
the middle of the trace had its torch calls recorded and replayed by every call (a
counter it bumps once in eager, bumped at every call).  Collections resume after the
trace, and its finalizers run then, as written; a `gc.collect()` the forward calls
itself still runs, as the forward's code.
"""
from __future__ import annotations

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
