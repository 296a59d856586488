"""A hooked submodule's call in a generated runner: its hooks run with the evaluator
out of the way, its forward armed.

A submodule with hooks is one opaque node of its parent's graph (capture/tracer.py):
at hit time the runner calls it for real, and its forward, a target, is intercepted
and served from its own cache.  Called as `module(...)` from the armed runner, every
Python frame of its hooks (and of whatever they call) also runs under the evaluator:
CPython stops inlining Python-to-Python calls while any PEP 523 evaluator is set
(about 270 instructions a frame on 3.11), and ours then decides each frame.

`call_hooked` does what `nn.Module.__call__` does (torch's `_call_impl`: forward
pre-hooks, forward, forward hooks, `always_call` hooks on an exception), itself run by
`_C.call_disarmed` (nothing armed on this thread, the evaluator uninstalled unless
another thread needs it), with the forward alone called through `_C.call_resumed`
(armed again as the runner was).  Whatever this module does not reproduce line for
line it hands to `nn.Module.__call__`, armed, as before: backward hooks (their
`BackwardHook` wiring), a class with its own `_call_impl` or `_wrapped_call_impl`, an
`nn.Module.__call__` patched by someone, a module compiled on its own
(`_compiled_call_impl`), TorchScript tracing, Dynamo compiling.

The node stands for `nn.Module.__call__` (what the trace intercepted), not for the
class's own `__call__`: a subclass whose `__call__` wraps `super().__call__()` had its
own code traced into the graph around the node.

Sound whatever the hooks do: a hook that calls other modules runs them eagerly (or
through their own compiled wrappers, which arm themselves), as eager would; only a
plain submodule called from a hook is no longer captured on its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules import module as G

from nnscaler_eval import _C

_resumed = _C.call_resumed
_Module = nn.Module
_WRAPPED = nn.Module._wrapped_call_impl
_CALL_IMPL = nn.Module._call_impl
_tracing_state = torch._C._get_tracing_state
_is_compiling = torch.compiler.is_compiling


def splits(module: nn.Module) -> bool:
    """Can the runner call `module` through call_hooked (checked again per call, with
    `nn.Module.__call__` itself, which a capture in progress patches)?"""
    cls = type(module)
    return cls._wrapped_call_impl is _WRAPPED and cls._call_impl is _CALL_IMPL


def call_hooked(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """`nn.Module.__call__(module, *args, **kwargs)`, as nn.Module runs it; run under
    _C.call_disarmed."""
    cls = type(module)
    if (
        module._backward_hooks or module._backward_pre_hooks
        or G._global_backward_hooks or G._global_backward_pre_hooks
        or module._compiled_call_impl is not None
        or _Module.__call__ is not _WRAPPED or cls._wrapped_call_impl is not _WRAPPED
        or cls._call_impl is not _CALL_IMPL
        or _tracing_state() is not None or _is_compiling()
    ):
        return _resumed(_Module.__call__, module, *args, **kwargs)
    forward = module.forward
    result = None
    called_always: set = set()
    try:
        if G._global_forward_pre_hooks or module._forward_pre_hooks:
            with_kwargs = module._forward_pre_hooks_with_kwargs
            for hook_id, hook in (*G._global_forward_pre_hooks.items(),
                                  *module._forward_pre_hooks.items()):
                if hook_id in with_kwargs:
                    both = hook(module, args, kwargs)
                    if both is not None:
                        if isinstance(both, tuple) and len(both) == 2:
                            args, kwargs = both
                        else:
                            raise RuntimeError(
                                "forward pre-hook must return None or a tuple "
                                f"of (new_args, new_kwargs), but got {both}."
                            )
                else:
                    new_args = hook(module, args)
                    if new_args is not None:
                        args = new_args if isinstance(new_args, tuple) else (new_args,)
        result = _resumed(forward, *args, **kwargs)
        if G._global_forward_hooks or module._forward_hooks:
            always, with_kwargs = module._forward_hooks_always_called, module._forward_hooks_with_kwargs
            for hook_id, hook in (*G._global_forward_hooks.items(),
                                  *module._forward_hooks.items()):
                if hook_id in always or hook_id in G._global_forward_hooks_always_called:
                    called_always.add(hook_id)
                if hook_id in with_kwargs or hook_id in G._global_forward_hooks_with_kwargs:
                    hook_result = hook(module, args, kwargs, result)
                else:
                    hook_result = hook(module, args, result)
                if hook_result is not None:
                    result = hook_result
        return result
    except Exception:
        # the hooks registered with always_call=True that have not run yet run now,
        # each one's own exception silenced with a warning, as nn.Module does
        for hooks, always, with_kwargs, what in (
            (G._global_forward_hooks, G._global_forward_hooks_always_called, (),
             "global module forward hook"),
            (module._forward_hooks, module._forward_hooks_always_called,
             module._forward_hooks_with_kwargs, "module forward hook"),
        ):
            for hook_id, hook in hooks.items():
                if hook_id not in always or hook_id in called_always:
                    continue
                try:
                    if hook_id in with_kwargs:
                        hook_result = hook(module, args, kwargs, result)
                    else:
                        hook_result = hook(module, args, result)
                    if hook_result is not None:
                        result = hook_result
                except Exception as e:
                    _warn_silenced(what, e)
        raise


def _warn_silenced(what: str, error: Exception) -> None:
    import warnings

    warnings.warn(f"{what} with ``always_call=True`` raised an exception that was "
                  f"silenced as another error was raised in forward: {error}", stacklevel=3)


def module_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What an opaque `call_module` node stands for: `nn.Module.__call__`, not the
    class's own `__call__` (whose code around `super().__call__()` the trace recorded
    around the node).  The graphs handed to backends call this in place of such a
    node (capture/results.py); generated runners inline it."""
    return _Module.__call__(module, *args, **kwargs)
