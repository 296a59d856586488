"""Signals that arrive while a forward is traced are delivered where Python can unwind.

A Python signal handler runs between two bytecodes of whatever Python code runs when
the signal arrives.  During a capture that is often Python called from torch's C++:
a `TorchDispatchMode` (data_dependence), torch's fake tensors (a dynamic capture),
a weakref callback during a tensor's deallocation.  An exception the handler raises
there (`KeyboardInterrupt` from SIGINT's default handler, or one a user's handler
raises) unwinds through C++ frames that may not let it pass: the process aborted
with `terminate called after throwing an instance of 'python_error'`, and no
`finally` of the user's ran.

So while a trace runs on the main thread (`Tracer.run`), every signal whose handler
is a Python callable gets a handler that only notes it.  The noted signals are
delivered, by calling the handler that was in place, at points where the tracer's
own Python code runs outside torch's dispatch: before and after each torch call it
records, at each submodule call, and when the trace ends.  An interrupt still stops
a long forward at its next torch call, and reaches the caller as it would in eager.

Nested traces (a compiled module captured inside another's capture) share the
outermost one's handlers.  A handler the forward installs itself is left alone.
Other threads are not affected: Python runs signal handlers on the main thread only.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable, Optional

from nnscaler_eval.tracing import asynchronous
from nnscaler_eval.tracing.trace_state import run_to_completion

# The handlers replaced by the outermost active deferral: signal number -> handler.
_replaced: dict[int, Any] = {}
# Signals noted and not yet delivered, in order of arrival.
_pending: list[int] = []
_owner: Optional["Deferral"] = None
# The handlers put back last, for signals noted before and delivered after.
_pending_handlers: dict[int, Any] = {}


def _note(signum: int, frame: Any) -> None:
    _pending.append(signum)


def _python_handled() -> list[int]:
    found = []
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        if callable(handler) and handler is not _note:
            found.append(signum)
    return found


class Deferral:
    """One trace's share of the deferral (see the module docstring).

    `start()` and `stop()` are idempotent, and every mix of replaced and original
    handlers is valid, so an interrupt landing inside either leaves nothing behind
    once `stop()` has completed.
    """

    def __init__(self) -> None:
        self.active = False

    def start(self) -> None:
        global _owner
        if self.active:
            return
        self.active = True
        if _owner is not None or threading.current_thread() is not threading.main_thread():
            return
        _owner = self
        for signum in _python_handled():
            _replaced[signum] = signal.getsignal(signum)
            signal.signal(signum, _note)

    def stop(self) -> None:
        """Put the handlers back (outermost trace), then deliver what is pending."""
        run_to_completion(self._restore)
        if _owner is None:
            deliver()

    def _restore(self) -> None:
        global _owner
        if not self.active:
            return
        if _owner is self:
            for signum, handler in list(_replaced.items()):
                if signal.getsignal(signum) is _note:
                    signal.signal(signum, handler)
                _pending_handlers[signum] = handler
                del _replaced[signum]
            _owner = None
        self.active = False


def deliver() -> None:
    """Run the handlers of the signals noted so far (on the main thread).  A handler
    that raises ends the loop; signals left are delivered at the next point."""
    if not _pending or threading.current_thread() is not threading.main_thread():
        return
    caller = sys._getframe(1)
    while _pending:
        signum = _pending.pop(0)
        handler: Callable[..., Any] = (_replaced.get(signum) or _pending_handlers.get(signum)
                                       or signal.getsignal(signum))
        if handler is _note:
            continue    # put back by nobody: the original is lost, nothing to call
        if callable(handler):
            # The handler is not the forward's: not recorded, not checked (asynchronous.py).
            saved = asynchronous.plain()
            try:
                handler(signum, caller)
            finally:
                asynchronous.resume(saved)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)   # the default action, as it would have been


def pending() -> bool:
    """Is a signal waiting to be delivered?  (A list's truth: cheap on every call.)"""
    return bool(_pending)
