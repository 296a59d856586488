"""Runs on fake tensors that the user never asked for make no output.

A dynamic capture runs the forward on fakes, and data_dependence runs single ops on
fakes; when torch's fake implementation of an op fails there, torch logs the failure
with a traceback at ERROR level (`failed while attempting to run meta for ...`)
before raising.  The capture takes the failure as an answer (the call is captured
statically, the op judged data-dependent), so the log is noise on a stderr that
eager leaves empty.  `quiet()` drops the records of torch's fake-tensor loggers on
this thread while such a run is under way; other threads, and the same loggers at
any other time, are untouched.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

# The loggers torch's fake tensors and shape environment log failures to.
_LOGGERS = ("torch._subclasses.fake_tensor", "torch._subclasses.fake_impls",
            "torch.fx.experimental.symbolic_shapes")

_state = threading.local()


class _QuietOnThisThread(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_state, "depth", 0)


_FILTER = _QuietOnThisThread()
for _name in _LOGGERS:
    logging.getLogger(_name).addFilter(_FILTER)
del _name


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No records from torch's fake-tensor loggers on this thread meanwhile."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
