"""Which capture tracer, if any, is recording on this thread.

Functions that must show up as single graph nodes (`ifexpr`, ops registered with
`register_op`, submodules with hooks) ask `current_tracer()` and hand themselves to it.

Also the process-wide state of capturing: `run_to_completion` for restores that an
interrupt must not cut short, and the capture lock with the cache-limit accounting of
entries on their way to C (used by convert_frame).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional

_local = threading.local()


def current_tracer() -> Optional[Any]:
    """The tracer recording on this thread, or None."""
    return getattr(_local, "tracer", None)


def set_current_tracer(tracer: Optional[Any]) -> Optional[Any]:
    """Install `tracer` for this thread; returns the previous one (to restore)."""
    previous = getattr(_local, "tracer", None)
    _local.tracer = tracer
    return previous


def run_to_completion(fn: Callable[..., None], *args: Any, attempts: int = 8) -> None:
    """`fn(*args)`, called again if an exception lands inside it; the first one is
    raised once a call has completed.

    For restores in `finally` blocks: an asynchronous exception (KeyboardInterrupt from
    a signal handler) can land between any two bytecodes of `fn`, which must therefore
    be idempotent. Recursion, not a loop: the backward jump of a loop is itself a point
    where a pending signal's handler runs, outside any `try`. After `attempts` failed
    calls (a real error, not an interrupt) the last error is raised.
    """
    try:
        fn(*args)
    except BaseException:
        if attempts > 1:
            run_to_completion(fn, *args, attempts=attempts - 1)
        raise


# ---------------------------------------------------------------------------
# One capture at a time (convert_frame)
#
# Captures from the frame evaluator run one at a time, process-wide, so that the
# cache_size_limit check and the entry it lets in are counted together, and so that
# two threads never trace the same shared modules at once. A thread that misses while
# another one captures does not wait: it runs that call as in eager, its callees too
# (uncached, counted as a fallback; its next miss tries again). Waiting would deadlock whenever the capturing forward waits for
# a thread that itself calls a compiled module (DataParallel-style workers, a queue
# served by another thread). An RLock: a capture that reaches a nested capture on its
# own thread goes on.

_capture_lock = threading.RLock()


def capture_depth() -> int:
    """How many holds of the capture lock this thread has (0 if none)."""
    return _capture_lock._recursion_count()


def try_enter_capture() -> bool:
    """Take the capture lock without waiting; False if another thread holds it.

    Read `capture_depth()` before, and `leave_capture(depth)` in a `finally` that
    covers this call: an interrupt landing just after the lock was taken is then
    still undone."""
    return _capture_lock.acquire(blocking=False)


def leave_capture(depth: int) -> None:
    """Release the capture lock down to `depth` holds; idempotent."""
    while _capture_lock._recursion_count() > depth:
        _capture_lock.release()


# Entries handed back to C whose insertion into their bucket may not have happened
# yet: C inserts after convert_frame returned, outside the lock, so the limit check
# counts them too. convert_frame returns them in a `_Reply` (a tuple, as C expects),
# referenced here weakly: C holds the reply until it has inserted the entry and is
# done with the call, so an entry is in flight while its reply is alive and not yet
# inserted (C sets its key on insertion: key_hash is 0 before). Nothing is pinned.


class _Reply(tuple):
    """convert_frame's `(result, entry)`: a tuple, as C expects, holding the one
    reference to its `_InFlight` marker, which this module references weakly
    (tuples themselves cannot be)."""


class _InFlight:
    __slots__ = ("entry", "__weakref__")

    def __init__(self, entry: Any) -> None:
        self.entry = entry


_in_flight: list[tuple[int, "weakref.ref[_InFlight]"]] = []


def in_flight_reply(bucket: Any, result: Any, entry: Any) -> tuple:
    """The reply handing `entry` to C for `bucket` (capture lock held)."""
    reply = _Reply((result, entry))
    marker = reply.marker = _InFlight(entry)  # type: ignore[attr-defined]
    _in_flight.append((id(bucket), weakref.ref(marker)))
    return reply


def _still_in_flight(ref: "weakref.ref[_InFlight]") -> bool:
    marker = ref()
    return marker is not None and marker.entry.key_hash == 0


def entries_with_in_flight(bucket: Any) -> int:
    """`len(bucket.entries)` plus this bucket's entries on their way into it (capture
    lock held). A reply alive means C's miss handler, which holds the bucket, has not
    finished: the id of a bucket with an entry in flight cannot have been reused."""
    _in_flight[:] = [item for item in _in_flight if _still_in_flight(item[1])]
    return len(bucket.entries) + sum(1 for key, _ in _in_flight if key == id(bucket))
