"""Library code that asks "am I being compiled?" takes its compile-safe path during a
capture, on the capturing thread only.

transformers (`is_torchdynamo_compiling`) and others skip data-dependent checks
(`if (mask == 1).all(): ...`, padding checks, MoE routing shortcuts) when
`torch.compiler.is_compiling()` is true, because a tracer cannot follow Python
control flow on tensor values.  A concrete trace has the same limit: without this the
forward falls back at the root on checks that `torch.compile` skips.  The answer is
true only while this thread captures (the eager thread beside it still gets torch's
answer), and `dynamo_is_compiling()` keeps torch's own answer for our code, which must
tell a real Dynamo trace apart from ours.

The function is swapped on `torch.compiler` (what transformers calls through) while any
thread captures; callers that imported the function object itself before a capture
keep torch's answer.  Inside a function that `torch.utils.checkpoint` runs, the answer
is torch's even during a capture: backward runs that function again outside any
capture, and its recomputation must take the path the capture took.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from typing import Callable, Iterator

import torch
import torch.utils.checkpoint as checkpoint

from nnscaler_eval.tracing import trace_state

_torch_is_compiling: Callable[[], bool] = torch.compiler.is_compiling


def dynamo_is_compiling() -> bool:
    """torch's own answer: a real torch.compile / export trace is running."""
    return _torch_is_compiling()


def _checkpoint_codes() -> frozenset:
    """The code objects that run a checkpointed function (torch.utils.checkpoint:
    `checkpoint` under its decorators, and the reentrant variant's forward)."""
    functions = (inspect.unwrap(checkpoint.checkpoint), checkpoint.CheckpointFunction.forward)
    return frozenset(fn.__code__ for fn in functions if hasattr(fn, "__code__"))


_CHECKPOINT_CODES: frozenset = frozenset()


def _in_checkpointed_function() -> bool:
    global _CHECKPOINT_CODES
    if not _CHECKPOINT_CODES:
        _CHECKPOINT_CODES = _checkpoint_codes()
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _CHECKPOINT_CODES:
            return True
        frame = frame.f_back
    return False


_running_for_real = threading.local()


@contextlib.contextmanager
def eager_answers() -> Iterator[None]:
    """Code run for real during a capture (a module the graph calls opaquely, run
    again on every hit) gets torch's answer, as it will on those hits."""
    previous = getattr(_running_for_real, "on", False)
    _running_for_real.on = True
    try:
        yield
    finally:
        _running_for_real.on = previous


def _is_compiling() -> bool:
    # The thread holding the capture lock is the one capturing (one capture at a
    # time, process-wide: trace_state).  Derived from the lock, not from a counter of
    # our own: an interrupt can land between any two bytecodes, and the lock is the
    # one piece of this state that is repaired in a `finally` whatever happens.
    if trace_state.capture_depth() and not getattr(_running_for_real, "on", False):
        # A checkpointed function runs again in backward, where no capture is on and
        # this says False: during the capture it takes that same path (eager's), or
        # the recomputation differs and checkpoint raises CheckpointError.
        return not _in_checkpointed_function()
    return _torch_is_compiling()


_is_compiling.__doc__ = _torch_is_compiling.__doc__
_is_compiling.__wrapped__ = _torch_is_compiling  # type: ignore[attr-defined]


@contextlib.contextmanager
def compile_safe_paths() -> Iterator[None]:
    """While active, `torch.compiler.is_compiling()` is true on this thread.

    Entered with the capture lock held (convert_frame), so one thread at a time
    swaps and restores: no lock or counter of its own (a `with lock:` is not
    interrupt-safe on 3.13+, csrc/held_lock.h).  An interrupt that skips the restore
    leaves a swap that answers as torch does on every thread not capturing, and the
    next capture's exit restores it."""
    torch.compiler.is_compiling = _is_compiling
    try:
        yield
    finally:
        if trace_state.capture_depth() <= 1:   # the outermost capture on this thread
            torch.compiler.is_compiling = _torch_is_compiling
