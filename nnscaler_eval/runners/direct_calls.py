"""Torch's C entry points in place of its Python wrappers, in generated runners.

A graph records what the user called: `F.dropout`, `F.layer_norm`, `Tensor.split`...
Each of those is a Python function that checks for `__torch_function__` overrides,
normalises its arguments and calls one C function (`torch.dropout`, `torch.layer_norm`,
`torch._VF.split`...).  On a hit, that Python frame (and `_VF`'s module `__getattr__`,
and `torch.backends.cudnn.enabled`'s property) is most of the runner's time on a small
model: 126 of a 12-block GPT's 128 Python frames per call.

`lower(node, trusted)` says, for one node, which C call does exactly what the wrapper
would do with these arguments, or None.  It only answers when:

- every argument the wrapper inspects is a constant of the graph (the probability of a
  dropout, `inplace`, a split size...) and the wrapper would accept it: the wrapper's
  own checks are made here, at code generation, with the wrapper's own expressions;
- every tensor argument was an exact `torch.Tensor` or `nn.Parameter` when captured
  (`PLAIN_META`, set by the tracer), and is produced by nodes whose result types follow
  from their inputs' (`trusted_nodes`): placeholders (their types are in the call key),
  attributes (bound objects), torch's C functions, tensor methods and operators.  A node
  fed by anything opaque (a registered op, a hooked submodule, an autograd Function)
  keeps the wrapper: its result's type could differ at hit time.

What is left is the wrapper's `has_torch_function` check, which with plain tensors is
true only while a TorchFunctionMode is active.  The runner asks that per call site
(`torch._C._is_torch_function_mode_enabled()`, one C call) and calls the wrapper then,
so a mode sees the function the user called, as in eager.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from nnscaler_eval.runtime import ifexpr

# node.meta key: every tensor among the call's arguments was an exact Tensor or
# Parameter when it was captured (no `__torch_function__` of its own).
PLAIN_META = "nnscaler_plain_tensors"

PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)

# What the runner asks before each direct call (a TorchFunctionMode active: the wrapper).
MODE_ACTIVE = torch._C._is_torch_function_mode_enabled

_VF = torch._C._VariableFunctions


@dataclass(frozen=True)
class CallAtRunTime:
    """An argument of a direct call computed each time the runner runs: `function()`
    (what the wrapper reads at that point, such as `torch.backends.cudnn.enabled`)."""

    function: Any


@dataclass(frozen=True)
class DirectCall:
    """`function(*args, **kwargs)` (fx arguments: nodes and constants) computes what the
    node's wrapper would; with `method`, `args[0].method(*args[1:], **kwargs)`."""

    function: Any = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    method: Optional[str] = None


def args_are_plain(args: Any, kwargs: Any, fakes: tuple[type, ...] = ()) -> bool:
    """For the tracer: no tensor among `args`/`kwargs` (nested in lists, tuples, dicts)
    has a type of its own.  `fakes`: types that stand for plain tensors in this trace
    (a dynamic capture's FakeTensor, whose every input is a plain tensor)."""
    stack = [args, kwargs]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if type(value) not in PLAIN_TENSOR_TYPES and type(value) not in fakes:
                return False
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
    return True


# ---------------------------------------------------------------- trusted producers

_TYPE_FOLLOWING_MODULES = ("torch.nn.functional", "torch.functional", "torch._tensor")


def _follows_input_types(target: Any) -> bool:
    """A call_function target whose result's type is decided by its inputs' types:
    torch's C functions, the operators, our ifexpr, and torch's own Python wrappers of
    the first two.  Not an autograd Function's `apply`, not a registered op."""
    if isinstance(target, types.BuiltinFunctionType):
        return True
    if target is ifexpr or target is getattr:
        return True
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        return True
    return (isinstance(target, types.FunctionType)
            and target.__module__ in _TYPE_FOLLOWING_MODULES)


def trusted_nodes(graph_nodes: list[fx.Node], attr_values: Any) -> set[fx.Node]:
    """Nodes whose value at hit time has the type it had at capture, given that the
    call key pins the inputs' types (graph order, so producers come first)."""
    trusted: set[fx.Node] = set()
    for node in graph_nodes:
        if node.op == "placeholder":
            ok = True
        elif node.op == "get_attr":
            ok = not isinstance(attr_values.get(str(node.target)), nn.Module)
        elif node.op == "call_method":
            ok = True
        elif node.op == "call_function":
            ok = _follows_input_types(node.target)
        else:
            ok = False
        if ok:
            ok = all(a in trusted for a in node.all_input_nodes)
        if ok:
            trusted.add(node)
    return trusted


# ---------------------------------------------------------------- the wrappers

def _bind(signature_of: Callable[..., Any], args: tuple, kwargs: dict) -> Optional[dict]:
    try:
        bound = inspect.signature(signature_of).bind(*args, **kwargs)
    except TypeError:
        return None   # the wrapper would raise: keep it, so that it does
    bound.apply_defaults()
    return dict(bound.arguments)


def _dropout(args: tuple, kwargs: dict) -> Optional[DirectCall]:
    a = _bind(F.dropout, args, kwargs)
    if a is None:
        return None
    p, inplace = a["p"], a["inplace"]
    if isinstance(p, fx.Node) or not isinstance(p, (int, float)) or not isinstance(inplace, bool):
        return None
    if p < 0.0 or p > 1.0:   # the wrapper's own test: it raises then
        return None
    function = _VF.dropout_ if inplace else _VF.dropout
    return DirectCall(function, (a["input"], p, a["training"]))


def _layer_norm(args: tuple, kwargs: dict) -> Optional[DirectCall]:
    a = _bind(F.layer_norm, args, kwargs)
    if a is None or _CUDNN_ENABLED is None:
        return None
    return DirectCall(torch.layer_norm, (a["input"], a["normalized_shape"], a["weight"],
                                         a["bias"], a["eps"], CallAtRunTime(_CUDNN_ENABLED)))


def _embedding(args: tuple, kwargs: dict) -> Optional[DirectCall]:
    a = _bind(F.embedding, args, kwargs)
    if a is None or a["padding_idx"] is not None or a["max_norm"] is not None:
        return None   # both read the weight's size or renormalise it: the wrapper's job
    return DirectCall(torch.embedding, (a["weight"], a["input"], -1, a["scale_grad_by_freq"],
                                        a["sparse"]))


def _split(args: tuple, kwargs: dict) -> Optional[DirectCall]:
    a = _bind(torch.Tensor.split, args, kwargs)
    if a is None:
        return None
    size = a["split_size"]
    if isinstance(size, int):
        return DirectCall(_VF.split, (a["self"], size, a["dim"]))
    if isinstance(size, (list, tuple)) and all(isinstance(s, int) for s in size):
        return DirectCall(_VF.split_with_sizes, (a["self"], size, a["dim"]))
    return None


def _softmax(args: tuple, kwargs: dict) -> Optional[DirectCall]:
    a = _bind(F.softmax, args, kwargs)
    if a is None or not isinstance(a["dim"], int):
        return None   # dim None: the wrapper picks one, with a warning
    if a["dtype"] is None:
        return DirectCall(args=(a["input"], a["dim"]), method="softmax")
    return DirectCall(args=(a["input"], a["dim"]), kwargs={"dtype": a["dtype"]},
                      method="softmax")


def _relu(args: tuple, kwargs: dict) -> Optional[DirectCall]:
    a = _bind(F.relu, args, kwargs)
    if a is None or not isinstance(a["inplace"], bool):
        return None
    return DirectCall(torch.relu_ if a["inplace"] else torch.relu, (a["input"],))


def _silu(args: tuple, kwargs: dict) -> Optional[DirectCall]:
    a = _bind(F.silu, args, kwargs)
    if a is None or not isinstance(a["inplace"], bool):
        return None
    return DirectCall(torch._C._nn.silu_ if a["inplace"] else torch._C._nn.silu, (a["input"],))


def _cudnn_enabled_getter() -> Any:
    """The C getter behind `torch.backends.cudnn.enabled` (a property of the module's
    class, torch.backends.ContextProp), or None if torch changed how it is read."""
    prop = type(torch.backends.cudnn).__dict__.get("enabled")
    getter = getattr(prop, "getter", None)
    return getter if isinstance(getter, types.BuiltinFunctionType) else None


_CUDNN_ENABLED = _cudnn_enabled_getter()

# call_function targets, and tensor methods (call_method names), with their rule.
_FUNCTIONS: dict[Any, Callable[[tuple, dict], Optional[DirectCall]]] = {
    F.dropout: _dropout,
    F.layer_norm: _layer_norm,
    F.embedding: _embedding,
    F.softmax: _softmax,
    F.relu: _relu,
    F.silu: _silu,
}
_METHODS: dict[str, Callable[[tuple, dict], Optional[DirectCall]]] = {
    "split": _split,
}


def lower(node: fx.Node, trusted: set[fx.Node]) -> Optional[DirectCall]:
    """The C call equivalent to `node` (see the module docstring), or None."""
    if node.op == "call_function":
        try:
            rule = _FUNCTIONS.get(node.target)
        except TypeError:   # an unhashable target
            return None
    elif node.op == "call_method":
        rule = _METHODS.get(str(node.target))
    else:
        return None
    if rule is None or node.meta.get(PLAIN_META) is not True:
        return None
    if not all(a in trusted for a in node.all_input_nodes):
        return None
    return rule(tuple(node.args), dict(node.kwargs))

