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
keep torch's answer.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

_torch_is_compiling: Callable[[], bool] = torch.compiler.is_compiling
_lock = threading.Lock()
_capturing_threads = 0
_local = threading.local()


def dynamo_is_compiling() -> bool:
    """torch's own answer: a real torch.compile / export trace is running."""
    return _torch_is_compiling()


def _is_compiling() -> bool:
    if getattr(_local, "depth", 0):
        return True
    return _torch_is_compiling()


_is_compiling.__doc__ = _torch_is_compiling.__doc__
_is_compiling.__wrapped__ = _torch_is_compiling  # type: ignore[attr-defined]


@contextlib.contextmanager
def compile_safe_paths() -> Iterator[None]:
    """While active, `torch.compiler.is_compiling()` is true on this thread."""
    global _capturing_threads
    with _lock:
        _capturing_threads += 1
        torch.compiler.is_compiling = _is_compiling
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        with _lock:
            _capturing_threads -= 1
            if _capturing_threads == 0:
                torch.compiler.is_compiling = _torch_is_compiling
