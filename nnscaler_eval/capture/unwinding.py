"""What an interrupt leaves half done, finished where a capture ends.

An asynchronous exception (`KeyboardInterrupt` from a signal handler, `SystemExit`, any
`BaseException` a handler raises) can land inside a context manager's own `__enter__`
or `__exit__`, after its change to the process and before the `with` statement is in
charge of undoing it: torch's `_pop_mode_temporarily` (a torch-function mode popped),
`unset_fake_temporarily` (the fake mode unset), `in_kernel_invocation_manager`.  The
generator then stays suspended, held by a finished frame the exception's traceback
keeps, and undoes its change whenever that frame is freed: when the traceback goes or,
when it sits in a reference cycle, whenever the cyclic GC runs, long after the capture
put the process back.  The undo then sets a mode nobody holds any more: a capture's
fake mode left set, and the next eager call computes on fake tensors.  Torch code that
fails while unwinding from the interrupt raises its own error, the interrupt in its
`__context__`, so the interrupt may be anywhere in the exception's chain.

So the boundary of a capture (`Boundary`, around convert_frame's work and export's
capture) finishes such an exception before it leaves, in this order:

1. the library frames (torch's, the standard library's, ours) of every traceback in the
   chain are cleared: the abandoned generators' `finally`s run now, not at some GC;
2. the torch modes are put back as they were when the capture began (`ModeState`: the
   fake, proxy and functional dispatch modes, then each mode stack's depth).

The user's frames keep their locals, for post-mortem debugging.  An exception that
holds an interrupt is never turned into a fallback or a static retry (`interrupt_in`),
and the boundary raises the interrupt itself: Ctrl-C reaches the caller as
`KeyboardInterrupt`, as in eager, the error that masked it in its `__context__`.
"""
from __future__ import annotations

import types
from typing import Any, Optional

import torch

from nnscaler_eval.capture.checked import BranchRefused
from nnscaler_eval.tracing.locations import is_library_file
from nnscaler_eval.tracing.trace_state import run_to_completion

# BaseExceptions that are not interrupts: a generator being closed, and a branch
# side's refusal (checked.py), which is a BaseException only to pass `except Exception`.
_NOT_INTERRUPTS = (GeneratorExit, BranchRefused)

_MODE_KEYS = tuple(
    getattr(torch._C._TorchDispatchModeKey, name)
    for name in ("FAKE", "PROXY", "FUNCTIONAL")
    if hasattr(torch._C._TorchDispatchModeKey, name)
)


def _chain(exc: Optional[BaseException]) -> list[BaseException]:
    """`exc` and every exception it was raised from or while handling."""
    found: list[BaseException] = []
    todo = [exc]
    while todo and len(found) < 64:
        cur = todo.pop()
        if cur is None or any(cur is f for f in found):
            continue
        found.append(cur)
        todo.extend((cur.__cause__, cur.__context__))
    return found


def interrupt_in(exc: Optional[BaseException]) -> Optional[BaseException]:
    """The interrupt `exc` is, or was raised while unwinding from; else None."""
    for cur in _chain(exc):
        if not isinstance(cur, Exception) and not isinstance(cur, _NOT_INTERRUPTS):
            return cur
    return None


class ModeState:
    """The torch modes in force when a capture began, to be put back."""

    def __init__(self) -> None:
        self.infra = [(key, torch._C._get_dispatch_mode(key)) for key in _MODE_KEYS]
        self.dispatch_depth = torch._C._len_torch_dispatch_stack()
        self.function_depth = torch._C._len_torch_function_stack()

    def restore(self) -> None:
        """Idempotent: the infra dispatch modes first (each its own slot), then pop
        what is above each stack's depth (a mode pushed and never popped)."""
        for key, mode in self.infra:
            if torch._C._get_dispatch_mode(key) is not mode:
                torch._C._unset_dispatch_mode(key)
                if mode is not None:
                    torch._C._set_dispatch_mode(mode)
        while torch._C._len_torch_dispatch_stack() > self.dispatch_depth:
            torch._C._pop_torch_dispatch_stack(None)
        while torch._C._len_torch_function_stack() > self.function_depth:
            torch._C._pop_torch_function_stack()


def _clear_library_frames(exc: BaseException) -> None:
    for cur in _chain(exc):
        tb: Optional[types.TracebackType] = cur.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if is_library_file(frame.f_code.co_filename):
                try:
                    frame.clear()
                except RuntimeError:   # still running: the boundary's own frame
                    pass
            tb = tb.tb_next


class Boundary:
    """`with Boundary():` around a capture.  An exception that holds an interrupt is
    finished on its way out: what it abandoned runs, the modes are put back as they
    were on entry, and the interrupt itself leaves (a script's `except
    KeyboardInterrupt` must see Ctrl-C, not the error torch raised while unwinding
    from it).  A class, not a generator: its exit is what runs the generators an
    interrupt abandoned."""

    def __enter__(self) -> "Boundary":
        self.modes = ModeState()
        return self

    def __exit__(self, kind: Any, exc: Optional[BaseException], tb: Any) -> None:
        interrupt = interrupt_in(exc)
        if interrupt is None or exc is None:
            return
        run_to_completion(_clear_library_frames, exc)
        run_to_completion(self.modes.restore)
        if interrupt is not exc:
            raise interrupt
