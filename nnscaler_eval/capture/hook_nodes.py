"""Forward hooks run as graph nodes, around their module's traced forward.

A submodule with hooks is one opaque node, run for real with its hooks (calls.
runs_opaque).  That cannot capture a forward that reads a tensor a hook hands out of
the module's call by another way than its result: transformers' output capturing
(`output_attentions=True`, `output_hidden_states=True`) has every attention module's
hook put its weights, made inside the decoder layer's call, into a collector the
model's forward then returns.  The trace meets such a tensor as one it never saw made;
that call runs eagerly (`escaped`), and the forward hooks of the modules that ran
opaque in it are *followed* from then on: a module whose forward hooks (and only
forward hooks: no pre-hooks, no backward or global hooks) include one of that code
has its forward traced inline like any submodule's, and each of its forward hooks is
one `call_function` node, `run_forward_hook(hook, module, args, kwargs, result,
with_kwargs)`, run for real on every call with that call's values, as eager runs it
(with the frame evaluator out of the way, as an opaque module's hooks run); what it
returns replaces the result, for every later use.

Hooks are still user code with side effects: they run on every call, never only at
capture time.  A symbolic capture, which runs on fakes, keeps such modules opaque (and
so captures statically).
"""

from __future__ import annotations

import types
from typing import Any

import torch.nn as nn

from nnscaler_eval.capture import calls

# The code of forward hooks that are followed (see the module docstring).
_followed: set[types.CodeType] = set()


def _code(hook: Any) -> Any:
    code = getattr(hook, "__code__", None)
    if code is None:
        code = getattr(getattr(hook, "__call__", None), "__code__", None)
    return code


def followed(module: nn.Module) -> bool:
    """Does a call of `module` trace its forward and run its forward hooks as nodes?"""
    if not _followed or not calls.forward_hooks_only(module):
        return False
    return any(_code(hook) in _followed for hook in module._forward_hooks.values())


def escaped(opaque: dict[int, nn.Module]) -> list[str]:
    """A tensor made inside an opaque call reached the graph: follow the forward hooks
    of the modules that ran opaque (those opaque for forward hooks alone).  Their
    names, for the reason given."""
    names = []
    for module in opaque.values():
        if calls.forward_hooks_only(module):
            for hook in module._forward_hooks.values():
                code = _code(hook)
                if code is not None:
                    _followed.add(code)
            names.append(type(module).__name__)
    return names


def forget() -> None:
    """Follow no hooks (`nnscaler.reset()`)."""
    _followed.clear()
