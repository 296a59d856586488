"""Classifying calls: how each torch call is written in the graph, which of its results
are constants and which end the capture, and which module calls run opaque.

The tracer asks; this module only answers, from the call and its result.
- `classify(func)`: a Tensor property read / write, a Python operator, a Tensor method
  or a plain function;
- `tensorless_result(...)`: a call that returned no tensor is a node (a side effect),
  a metadata constant (guarded by the caller's shape checks), or a graph break;
- `DATA_ACCESS`: Tensor methods that hand tensor data to Python (always a break)
  (which ops make shapes from tensor values is data_dependence's question);
- `runs_opaque(module)`: a submodule call that is one opaque `call_module` node, run
  for real (it has hooks, or its ops run where the tracer cannot see them), instead of
  being inlined.
"""

from __future__ import annotations

import inspect
import operator
import sys
import types
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.modules.module as module_globals
from torch.utils.hooks import RemovableHandle

from nnscaler_eval.tracing import trace_patches

# Values that go into the graph as literals.
LITERAL_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    type(Ellipsis),
)
# Results that never depend on tensor data.
_METADATA_RESULT_TYPES = (torch.Size, torch.dtype, torch.device, torch.layout, torch.memory_format)
# Tensor methods and torch functions whose Python results are metadata, not data.
_METADATA_NAMES = frozenset(
    {
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "stride",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "element_size",
        "storage_offset",
        "get_device",
        "is_pinned",
        "is_shared",
        "is_set_to",
        "is_same_size",
        "is_inference",
        "is_conj",
        "is_neg",
        "has_names",
        "is_coalesced",
        "dense_dim",
        "sparse_dim",
        "__len__",
        "__hash__",
        "type",
        "is_tensor",
        "is_storage",
        "result_type",
        "promote_types",
        "can_cast",
        "_is_view",
        "is_nested",
        "dim_order",
    }
)
# Queries whose answer is a shape: not constants when the shape came from data.
SHAPE_QUERIES = frozenset({"size", "shape", "numel", "nelement", "__len__", "stride",
                           "storage_offset"})
# Tensor methods that hand tensor data to Python.
DATA_ACCESS = {
    "__bool__": "data-dependent control flow: bool() of a tensor",
    "item": "data-dependent value: Tensor.item()",
    "__int__": "data-dependent value: int() of a tensor",
    "__float__": "data-dependent value: float() of a tensor",
    "__complex__": "data-dependent value: complex() of a tensor",
    "__index__": "data-dependent value: a tensor used as a Python index",
    "tolist": "data-dependent value: Tensor.tolist()",
    "numpy": "data-dependent value: Tensor.numpy()",
    "__array__": "data-dependent value: a tensor converted to a NumPy array",
    "__format__": "data-dependent value: a tensor formatted into a string",
    "__repr__": "data-dependent value: repr() of a tensor",
    "__str__": "data-dependent value: str() of a tensor",
    "__contains__": "data-dependent control flow: `in` on a tensor",
    "data_ptr": "Tensor.data_ptr() (an address, different on every call)",
}
# Calls executed but not recorded: the tracer records their effect (grad mode) by
# comparing state before each op, which also sees changes made without a torch call.
# torch 2.13's `_set_grad_enabled` hands itself to torch function modes by its name in
# torch._C, which names our replacement while a trace runs: that one is the same call
# (recorded, it was a second node calling a function of ours, which no compiler cache
# can key).
STATE_CHANGES = frozenset({trace_patches.REAL_SET_GRAD_ENABLED,
                           trace_patches.PATCHED_SET_GRAD_ENABLED})

# Tensor dunders -> (operator function, reflected?)
OPERATORS: dict[str, tuple[Callable[..., Any], bool]] = {}
_BINARY_DUNDERS: list[tuple[str, Callable[..., Any]]] = [
    ("add", operator.add),
    ("sub", operator.sub),
    ("mul", operator.mul),
    ("truediv", operator.truediv),
    ("div", operator.truediv),
    ("floordiv", operator.floordiv),
    ("mod", operator.mod),
    ("pow", operator.pow),
    ("matmul", operator.matmul),
    ("and", operator.and_),
    ("or", operator.or_),
    ("xor", operator.xor),
    ("lshift", operator.lshift),
    ("rshift", operator.rshift),
]
_OTHER_DUNDERS: list[tuple[str, Callable[..., Any]]] = [
    ("eq", operator.eq),
    ("ne", operator.ne),
    ("lt", operator.lt),
    ("le", operator.le),
    ("gt", operator.gt),
    ("ge", operator.ge),
    ("getitem", operator.getitem),
    ("setitem", operator.setitem),
    ("neg", operator.neg),
    ("pos", operator.pos),
    ("abs", operator.abs),
    ("invert", operator.invert),
    ("iadd", operator.iadd),
    ("isub", operator.isub),
    ("imul", operator.imul),
    ("itruediv", operator.itruediv),
    ("ifloordiv", operator.ifloordiv),
    ("imod", operator.imod),
    ("ipow", operator.ipow),
    ("iand", operator.iand),
    ("ior", operator.ior),
    ("ixor", operator.ixor),
    ("ilshift", operator.ilshift),
    ("irshift", operator.irshift),
    ("imatmul", operator.imatmul),
]
for _dunder, _fn in _BINARY_DUNDERS:
    OPERATORS[f"__{_dunder}__"] = (_fn, False)
    OPERATORS[f"__r{_dunder}__"] = (_fn, True)
for _dunder, _fn in _OTHER_DUNDERS:
    OPERATORS[f"__{_dunder}__"] = (_fn, False)
del _dunder, _fn


def _tensor_attribute_names() -> dict[Any, str]:
    """Function object -> its name on `torch.Tensor`.

    Looked up by identity, not `__name__`: `Tensor.__pow__` is a wrapper of
    `TensorBase.pow` named "pow", and several dunders are aliases of methods. Where
    one function has several names, a plain method name wins (`x.abs()`), then a
    dunder that is an operator.
    """
    names: dict[Any, str] = {}
    for name in sorted(
        dir(torch.Tensor), key=lambda n: (n.startswith("__"), n not in OPERATORS, n)
    ):
        try:
            value = getattr(torch.Tensor, name)
            names.setdefault(value, name)
        except (AttributeError, TypeError):  # unhashable or odd class attributes
            continue
    return names


_TENSOR_ATTRIBUTE_NAMES = _tensor_attribute_names()


def classify(func: Callable[..., Any]) -> tuple[str, Any]:
    """How a torch call is written in the graph.

    ("getattr" | "setattr", attribute name): a tensor property read / write;
    ("operator", dunder name): a Tensor dunder, written as the Python operator;
    ("method", name): a Tensor method, written `x.name(...)`;
    ("function", func): anything else, called as a function.
    """
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__") and type(func).__name__ == "method-wrapper":
        descriptor = getattr(func, "__self__", None)
        attr = getattr(descriptor, "__name__", None) or _property_name(descriptor)
        if attr is not None:
            return ("getattr" if name == "__get__" else "setattr"), attr
    try:
        attribute = _TENSOR_ATTRIBUTE_NAMES.get(func)
    except TypeError:  # unhashable callable
        attribute = None
    if attribute is not None:
        if attribute in OPERATORS:
            return "operator", attribute
        return "method", attribute
    return "function", func


def _property_name(descriptor: Any) -> Optional[str]:
    """The name a Python property has on torch.Tensor (`data`, which state_guards puts
    in front of torch's own), not its getter's (`_get_data`)."""
    for cls in torch.Tensor.__mro__:
        for attr, value in vars(cls).items():
            if value is descriptor:
                return attr
    return getattr(getattr(descriptor, "fget", None), "__name__", None)


def qualname(func: Callable[..., Any]) -> str:
    kind, target = classify(func)
    if kind != "function":
        return f"Tensor.{target}"
    module = getattr(func, "__module__", None) or ""
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func))
    return f"{module}.{name}" if module else name


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Tensors inside the containers a torch call can take or return (not objects)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, slice):
        yield from tensors_in((value.start, value.stop, value.step))


def _has_call_hooks(module: nn.Module) -> bool:
    """Would `nn.Module._call_impl` run any hook for this module?  Its own fast-path
    test: the with_kwargs / always_called companions only qualify entries of these
    (torch leaves a removed global hook's with_kwargs mark behind)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or module_globals._global_forward_hooks
        or module_globals._global_forward_pre_hooks
        or module_globals._global_backward_hooks
        or module_globals._global_backward_pre_hooks
    )



# torch layers whose forward, in eval, takes a fused "fast path" (nested tensors
# for padding masks: padded rows come out exactly 0) only when no torch function
# mode is active: traced, they would take the other path, whose padded rows differ.
# In eval they run for real, as one node, so every call takes eager's own path.
_EVAL_FAST_PATHS = (nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.MultiheadAttention)


def undispatched_result(func: Any, args: tuple, kwargs: dict) -> Any:
    """What the torch function that dispatched to `func` computes without a torch
    function mode: eager's answer where the user replaced that torch function by a
    wrapper calling the original (`F.dropout = wrapper`), whose dispatch then names the
    wrapper, which would run twice.

    The original is the frame that called `handle_torch_function`: its code runs again
    on the arguments it holds, with torch function dispatch off.  Without such a
    frame, `func` itself runs (the best that can be done)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "handle_torch_function":
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    if caller is None:
        return func(*args, **kwargs)
    code = caller.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    names = code.co_varnames[:count]
    local = caller.f_locals
    if code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS) or \
            any(n not in local for n in names):
        return func(*args, **kwargs)
    original = types.FunctionType(code, caller.f_globals, code.co_name)
    positional = [local[n] for n in names[:code.co_argcount]]
    keywords = {n: local[n] for n in names[code.co_argcount:]}
    with torch._C.DisableTorchFunction():
        return original(*positional, **keywords)


def replaced_api(func: Any) -> Optional[tuple[str, Any]]:
    """Which torch API a user's wrapper replaced (a test helper's patch of
    `torch.Tensor.to`, `F.dropout = wrapper`): ("method", name) for a Tensor method,
    ("function", the original) for a function of torch's namespaces, or None.  Only
    where torch's own dispatch named the wrapper: a graph that calls the API by that
    name calls whatever is bound to it when it runs, as eager's code does."""
    for attr, value in vars(torch.Tensor).items():
        if value is func:
            return "method", attr
    for attr, value in vars(torch).items():
        original = getattr(torch._C._VariableFunctions, attr, None)
        if value is func and original is not None:
            return "function", original
    name = getattr(func, "__name__", None)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "handle_torch_function":
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    if caller is not None and caller.f_code.co_name == name and \
            getattr(sys.modules.get(caller.f_globals.get("__name__", "")), name, None) is func:
        # the original Python function (its code, in its module), as `undispatched_result`
        # runs it
        return "function", types.FunctionType(caller.f_code, caller.f_globals, name)
    return None


def takes_eval_fast_path(module: Any) -> bool:
    """`module` is a torch layer that eager runs through its fused eval path when it
    can (the plain bool `training`, read outside any trace)."""
    return isinstance(module, _EVAL_FAST_PATHS) and module.__dict__.get("training") is False


def _opaque_but_for_hooks(module: nn.Module) -> bool:
    """The reasons other than hooks for a call of `module` to be one opaque node."""
    return (
        getattr(module, "_compiled_call_impl", None) is not None
        or isinstance(module, torch.jit.ScriptModule)  # its ops run in C++, unseen
        # reading `training` here specialises the capture on it (a guard)
        or (isinstance(module, _EVAL_FAST_PATHS) and not module.training)
    )


def runs_opaque(module: nn.Module) -> bool:
    """Is a call of `module` one opaque node, run for real, rather than inlined?"""
    return _has_call_hooks(module) or _opaque_but_for_hooks(module)


def forward_hooks_only(module: nn.Module) -> bool:
    """Is `module` opaque for forward hooks alone (no pre-hooks, no backward or global
    hooks, none that must run when the forward raises, nothing else of runs_opaque's)?"""
    return bool(
        module._forward_hooks
        and not module._forward_pre_hooks
        and not module._backward_hooks
        and not module._backward_pre_hooks
        and not module._forward_hooks_always_called
        and not module_globals._global_forward_hooks
        and not module_globals._global_forward_pre_hooks
        and not module_globals._global_backward_hooks
        and not module_globals._global_backward_pre_hooks
        and not _opaque_but_for_hooks(module)
    )


def opaque_for_hooks_only(module: nn.Module) -> bool:
    """Is `module` an opaque node only because it has hooks (its forward a target of
    its own, nothing else of runs_opaque's)?"""
    return _has_call_hooks(module) and not _opaque_but_for_hooks(module)


def tensorless_result(func: Any, kind: str, target: Any, result: Any) -> tuple[str, str]:
    """What a torch call that returned no tensor is: ("node", "") a side effect to
    record as a node; ("metadata", "") a constant (a property, a shape, a dtype) that
    the caller's shape guards cover; ("break", reason) a Python value computed from
    tensor data, or a result the graph cannot hold."""
    if kind == "getattr":
        return "metadata", ""  # a property (shape, dtype, grad=None...): a constant
    if kind == "setattr" or result is None or isinstance(result, RemovableHandle):
        return "node", ""  # a side effect (x[i] = v, x.register_hook(f)): record it as a node
    if (
        isinstance(result, _METADATA_RESULT_TYPES)
        or (kind == "method" and target in _METADATA_NAMES)
        or (kind == "function" and getattr(func, "__name__", None) in _METADATA_NAMES)
        or func is torch.numel
        or func is torch.is_floating_point
        or func is torch.is_complex
    ):
        return "metadata", ""  # metadata: a constant, guarded by the caller's shape checks
    if isinstance(result, (bool, int, float, complex, str, list, tuple)) or (
        type(result).__module__ == "numpy"
    ):
        return "break", (
            f"data-dependent value: {qualname(func)}() returned a Python "
            f"{type(result).__name__}"
        )
    return "break", f"cannot record {qualname(func)}(): it returns a {type(result).__name__}"
