"""How an opaque `call_module` node is called.

The node stands for `nn.Module.__call__` (what the trace intercepted), not for the
class's own `__call__`: a subclass whose `__call__` wraps `super().__call__()` had its
own code traced into the graph around the node.  Generated runners call such a class
as `Module.__call__(module, ...)` inline; graphs handed to other backends call
`module_call` below in place of the node (capture/results.py).

A node opaque for its hooks alone is called, in generated runners, through
`_C.call_hooked` (csrc/hooked_call.c): nn.Module.__call__ with the hooks run with the
evaluator out of the way and the forward armed, so it still hits its own cache.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from nnscaler_eval import _C


def module_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`nn.Module.__call__(module, ...)`, whatever the class's own `__call__`."""
    return nn.Module.__call__(module, *args, **kwargs)


def run_forward_hook(hook: Any, module: nn.Module, args: tuple, kwargs: dict, result: Any,
                     with_kwargs: bool) -> Any:
    """A forward hook's node (capture/hook_nodes.py): the hook called as
    `nn.Module._call_impl` calls it, with the evaluator out of the way (as an opaque
    module's hooks run); the result it returns, or the module's when it returns None."""
    hook_args = (module, args, kwargs, result) if with_kwargs else (module, args, result)
    replaced = _C.call_disarmed(hook, *hook_args)
    return result if replaced is None else replaced
