"""Arming the frame evaluator: `enable()` and `disable()`.

`enable()` with no backend is the rewrite mode of nnScaler's self.training support:
every frame that runs inside and holds a `self.training` conditional expression runs
its rewritten bytecode.  `enable(backend=...)` is capture mode: every `forward` called
inside is captured, guarded, cached and dispatched.  `disable()` runs its body with
the evaluator off.  Both work as context managers and as decorators; they nest,
and their state follows the context (contextvars): each thread, and each asyncio
task, sees only the regions it entered itself.
"""
from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable, Optional, TypeVar, Union

from nnscaler_eval import _C
from nnscaler_eval.shared_objects import REWRITE_MODE, _RewriteMode
from nnscaler_eval.config import CompileConfig

F = TypeVar("F", bound=Callable[..., Any])
# What a region arms: a capture config, rewrite mode, or None (disable()).
ArmConfig = Optional[Union[CompileConfig, _RewriteMode]]


def _arm(config: ArmConfig) -> Any:
    """A capture config arms with its cache home; rewrite mode and None without."""
    arm = getattr(type(config), "arm", None)
    return arm(config) if arm is not None else _C.arm(config)


# The `with` blocks open in this context, innermost last: (the _Armed object, its
# token).  One variable for all of them, so that no context accumulates entries.
_open_blocks: contextvars.ContextVar[tuple[tuple[Any, Any], ...]] = contextvars.ContextVar(
    "nnscaler_eval.open_blocks", default=())


class _Armed:
    """Context manager and decorator that arms the current context with one config.

    Its open blocks are kept per context, so one object entered by two asyncio
    tasks (or threads) keeps their tokens apart."""

    def __init__(self, config: ArmConfig) -> None:
        self._config = config

    def __enter__(self) -> "_Armed":
        token = _arm(self._config)
        _open_blocks.set(_open_blocks.get() + ((self, token),))
        return self

    def __exit__(self, *exc: object) -> None:
        blocks = _open_blocks.get()
        for i in range(len(blocks) - 1, -1, -1):
            if blocks[i][0] is self:
                break
        else:
            raise RuntimeError(
                "nnscaler.eval_frame: __exit__ without a matching __enter__ in this "
                "context (thread or asyncio task)")
        _C.disarm(blocks[i][1])  # raises, leaving the block open, if out of order
        _open_blocks.set(blocks[:i] + blocks[i + 1:])

    def __call__(self, fn: F) -> F:
        config = self._config

        @functools.wraps(fn)
        def armed(*args: Any, **kwargs: Any) -> Any:
            token = _arm(config)
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
    return _Armed(CompileConfig.for_region(backend, **options))


def disable() -> _Armed:
    """Run the body with the frame evaluator off on this thread."""
    return _Armed(None)
