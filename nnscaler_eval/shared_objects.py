"""Objects the C core and the Python side share, defined once, below both: the
sentinels convert_frame answers with, the rewrite-mode config, the package directory
hidden from tracebacks, and torch's global module-hook registries.  A leaf: it
imports nothing of this package."""
from __future__ import annotations

import os

import torch.nn.modules.module as _module_mod


class _RewriteMode:
    """The config object that arms a thread in rewrite mode (no capture)."""

    def __repr__(self) -> str:
        return "<nnscaler rewrite mode>"


class _RunEagerly:
    """What convert_frame returns when the frame should simply be evaluated."""

    def __repr__(self) -> str:
        return "<nnscaler run eagerly>"


class _RunDisarmed:
    """What convert_frame returns when the frame, and the frames it calls, should run
    without interception (cache_size_limit reached)."""

    def __repr__(self) -> str:
        return "<nnscaler run disarmed>"


REWRITE_MODE = _RewriteMode()
RUN_EAGERLY = _RunEagerly()
RUN_DISARMED = _RunDisarmed()
# Frames of files under this directory are removed from tracebacks of user errors.
INTERNAL_PREFIX = os.path.dirname(os.path.abspath(__file__)) + os.sep

GLOBAL_HOOK_DICT_NAMES = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
)


def global_hook_items() -> list[tuple[str, dict]]:
    """(name, dict) of torch's global module-hook registries present in this torch."""
    items = []
    for name in GLOBAL_HOOK_DICT_NAMES:
        value = getattr(_module_mod, name, None)
        if isinstance(value, dict):
            items.append((name, value))
    return items


# The registries whose entries make nn.Module._call_impl leave its fast path; the
# *_with_kwargs / *_always_called companions only qualify their entries (and torch
# leaves a global hook's with_kwargs mark behind when the hook is removed).
CALL_HOOK_DICT_NAMES = GLOBAL_HOOK_DICT_NAMES[:4]


def global_hook_dicts() -> tuple[dict, ...]:
    """The global registries a module call checks for hooks (CALL_HOOK_DICT_NAMES)."""
    return tuple(d for name, d in global_hook_items() if name in CALL_HOOK_DICT_NAMES)
