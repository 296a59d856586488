"""Arming the frame evaluator: `enable()` and `disable()`.

`enable()` with no backend is the rewrite mode of nnScaler's self.training support:
every frame that runs inside and holds a `self.training` conditional expression runs
its rewritten bytecode.  `enable(backend=...)` is capture mode: every `forward` called
inside is captured, guarded, cached and dispatched.  `disable()` runs its body with
the evaluator off.  Both work as context managers and as decorators; they nest and
are per thread.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, TypeVar

from nnscaler_eval import _C
from nnscaler_eval._install import REWRITE_MODE

F = TypeVar("F", bound=Callable[..., Any])


class _Armed:
    """Context manager and decorator that arms the thread with one config."""

    def __init__(self, config: Any) -> None:
        self._config = config
        self._tokens: list[Any] = []

    def __enter__(self) -> "_Armed":
        self._tokens.append(_C.arm(self._config))
        return self

    def __exit__(self, *exc: object) -> None:
        _C.disarm(self._tokens.pop())

    def __call__(self, fn: F) -> F:
        config = self._config

        @functools.wraps(fn)
        def armed(*args: Any, **kwargs: Any) -> Any:
            token = _C.arm(config)
            try:
                return fn(*args, **kwargs)
            finally:
                _C.disarm(token)

        return armed  # type: ignore[return-value]


def enable(backend: Optional[Any] = None, **options: Any) -> _Armed:
    """Arm the frame evaluator on this thread (see the module docstring)."""
    if backend is None:
        if options:
            raise TypeError(
                f"enable(): options {sorted(options)} need a backend; without one, "
                "enable() is the rewrite mode and takes no options"
            )
        return _Armed(REWRITE_MODE)
    from nnscaler_eval.config import CompileConfig

    return _Armed(CompileConfig.create(backend=backend, **options))


def disable() -> _Armed:
    """Run the body with the frame evaluator off on this thread."""
    return _Armed(None)
