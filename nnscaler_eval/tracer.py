"""Capture of one forward call: a concrete tracer that runs it once, for real.

The C side intercepts a forward frame on a cache miss and calls `capture()` with the
frame's bound argument slots. The tracer runs the (rewritten) function once with the
real values, under a `TorchFunctionMode` that records every torch-level call into a
`torch.fx.Graph`; the run's result and side effects are the call's own (BatchNorm
statistics and counters are updated once, not twice). `Capture.make_runner()` then
turns the graph into the flat function the C hit path calls.

How values become graph values:

- tensors are tracked by identity (`id` -> producing node; every tensor seen is kept
  alive until the trace ends so ids are not reused). Tensor leaves of the slots are
  placeholders; parameters and buffers of the root's tree are `get_attr` nodes by
  qualified name (so in-place optimizer updates are seen without recapture); any
  other tensor met is a constant attribute.
- `module.training` is a `TrainingFlag` for the length of the trace (see
  tracked_values). Used as a value it becomes one placeholder per module, after the
  tensor placeholders (`Capture.training_inputs`); used to branch it specialises the
  graph (`Capture.branched_training`, which the caller guards).
- non-tensor results of metadata queries (`x.shape`, `x.dim()`, `x.dtype`) are
  constants: the caller guards input shapes. Tensors whose shape depends on data
  (`nonzero`, boolean masks, `unique`) are marked, and a shape query on them is a
  fallback instead of a baked constant.
- anything whose Python value depends on tensor data, and Python side effects that a
  replay would lose, end the capture with a `Fallback` (the run still finishes for
  real), or raise `GraphBreakError` at once with `fullgraph=True`.

Design note, submodules: calls are seen through a patched `nn.Module.__call__`
(trace_patches) and inlined, unless the module has call hooks: then it is one opaque
`call_module` node, called for real (its hooks run) with recording suspended and with
the real `training` values restored for its subtree, so no flag leaks into code that
is not being recorded.

Known limits are listed in `Capture`'s docstring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import linecache
import operator
import os
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.fx as fx
from torch.fx import _lazy_graph_module
import torch.nn as nn
import torch.nn.modules.module as module_globals
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from nnscaler_eval import _C, codegen, trace_patches
from nnscaler_eval._install import global_hook_items
from nnscaler_eval.fx_source import release_source_with
from nnscaler_eval.codegen import (
    ConstantOutput,
    GraphOutput,
    InputPath,
    OutputLayout,
    RunnerSpec,
    SlotOutput,
)
from nnscaler_eval.runtime import ifexpr
from nnscaler_eval.trace_state import current_tracer, run_to_completion, set_current_tracer
from nnscaler_eval.tracked_values import (
    TrackedFloat,
    TrackedInt,
    TrainingFlag,
    _TrackedNumber,
    plain_value,
    quiet_plain,
)

# ---------------------------------------------------------------------------
# Public results


@dataclass
class Fallback:
    """Why a frame cannot be captured, and the user's line that made it so."""

    reason: str
    filename: str
    lineno: int

    def __str__(self) -> str:
        return f"{self.reason} at {self.filename}:{self.lineno}"


class GraphBreakError(RuntimeError):
    """Raised instead of falling back when the caller asked for `fullgraph=True`."""

    def __init__(self, fallback: Fallback) -> None:
        super().__init__(
            f"cannot capture the whole forward in one graph (fullgraph=True): {fallback}"
        )
        self.fallback = fallback


@dataclass
class Capture:
    """The outcome of tracing one call.

    `graph_module` computes a flat tuple (the tensor and tracked-number leaves of the
    output); `make_runner` rebuilds the forward's real output structure around it.
    Placeholders: every tensor leaf of the slots, in slot order, then one bool per
    module in `training_inputs`.

    Keep the runner, not the Capture, in a cache: `graph_module` and `runner_spec`
    hold the root's submodules (the runner reaches them through its root slot).

    Known limits:
    - a flag or tracked number read directly by C code (`math.sqrt(p)`,
      `range(self.training)`, `x is True`) is specialised without a recorded branch;
      a flag handed to a C function with a `bool` parameter other than those
      trace_patches wraps (`x.requires_grad_(self.training)`) raises TypeError;
    - a tensor made outside torch function dispatch (a C extension, the legacy
      `torch.Tensor(...)` constructor, a `DisableTorchFunction` region) is a fallback
      when it has a grad_fn, else it is taken for a constant;
    - `torch.cond` branches are traced on fake tensors (see `Tracer.trace_cond`):
      Python side effects inside a branch happen at trace time only; activation
      checkpointing is inlined (same values and gradients, not its memory savings);
    - module state mutated inside a list/dict attribute is caught one level deep only;
      tensors hidden in non-pytree input objects are refused (fallback), not traced;
      `random`, `time`, logging and other Python-level effects are baked in or lost.

    Threads: `module.training` is a flag on the tracing thread only (trace_patches'
    descriptor); other threads using the same modules meanwhile see their bools.
    """

    result: Any
    graph_module: Optional[fx.GraphModule]
    fallback: Optional[Fallback]
    training_inputs: list[nn.Module]
    branched_training: list[tuple[nn.Module, bool]]
    visited_modules: list[nn.Module]
    opaque_modules: list[nn.Module]
    slot_names: tuple[str, ...]
    runner_spec: Optional[RunnerSpec] = field(default=None, repr=False)
    _example_inputs: list[Any] = field(default_factory=list, repr=False)
    # Python read tensor metadata (a dtype, a shape) that went into the graph as a
    # constant: then parameters' and constants' metadata is guarded too.
    read_metadata: bool = False

    def make_runner(
        self, compiled: Optional[Callable[..., Any]] = None, *, training_folded: bool = False
    ) -> Callable[..., Any]:
        """`runner(*slots, *training_flags) -> output`, equal to running the forward.

        With `compiled=None` the runner is the graph itself as straight-line Python (the
        "eager" backend). Otherwise `compiled(*placeholders)` is a backend's compiled
        graph: the runner extracts the placeholders from the slots, calls it, and
        rebuilds the output structure. `training_folded=True`: `compiled` was made from
        `backend_graph()`, whose placeholders are the tensor inputs only; the runner
        still takes the flags (and ignores them).
        """
        spec = self._spec()
        if training_folded:
            spec = dataclasses.replace(spec, graph=self._folded_graph().graph)
        return codegen.make_runner(spec, compiled)

    def backend_graph(self) -> tuple[fx.GraphModule, list[Any]]:
        """The graph and example inputs to hand a `torch.compile` backend.

        Training flags are folded to this run's values (`ifexpr` nodes resolved): AOT-
        based backends (aot_eager, inductor) bake non-tensor inputs in from the example
        values anyway, silently. So with this graph every module of `training_inputs`
        needs a guard on its flag, exactly like `branched_training`; use
        `make_runner(compiled, training_folded=True)`.
        """
        folded = self._folded_graph()
        tensors = len(self._example_inputs) - len(self.training_inputs)
        return folded, self._example_inputs[:tensors]

    def _spec(self) -> RunnerSpec:
        if self.runner_spec is None:
            raise RuntimeError(
                f"this capture fell back to eager ({self.fallback}); it has no graph to run"
            )
        return self.runner_spec

    def _folded_graph(self) -> fx.GraphModule:
        spec = self._spec()
        assert self.graph_module is not None
        tensors = len(self._example_inputs) - len(self.training_inputs)
        flag_values = iter(self._example_inputs[tensors:])
        graph = fx.Graph()
        env: dict[fx.Node, Any] = {}
        for node in spec.graph.nodes:
            if node.op == "placeholder" and node.meta.get("nnscaler_input") is None:
                env[node] = next(flag_values)
            elif node.op == "call_function" and node.target is ifexpr:
                cond, true_value, false_value = fx.node.map_arg(node.args, env.__getitem__)
                if isinstance(cond, fx.Node):  # a condition the graph computes: keep it
                    env[node] = graph.node_copy(node, env.__getitem__)
                else:
                    env[node] = true_value if cond else false_value
            else:
                env[node] = graph.node_copy(node, env.__getitem__)
        # The copy reads its attributes from the capture's own GraphModule, which
        # holds the live parameters (and never writes to the user's modules).
        return fx.GraphModule(self.graph_module, graph, class_name=type(self.graph_module).__name__)

    def runner_source(self, compiled: Optional[Callable[..., Any]] = None) -> str:
        """The runner's generated source (for logs, `explain`, tests)."""
        return codegen.runner_source(self._spec(), compiled)[0]

    def example_inputs(self) -> list[Any]:
        """The placeholder values of the traced run, in placeholder order (for backends)."""
        return list(self._example_inputs)


def capture(
    fn: Callable[..., Any],
    slots: tuple[Any, ...],
    slot_names: tuple[str, ...],
    *,
    root: Optional[nn.Module],
    fullgraph: bool = False,
    call: Optional[Callable[[], Any]] = None,
) -> Capture:
    """Run `fn` once for real on `slots`, recording it; see the module docstring.

    `call` runs fn with the slots correctly rebound (needed when the code has `*args` /
    `**kwargs`); without it, `fn(*slots)`. An exception raised by the forward
    propagates unchanged, after every patch and `training` attribute is restored.
    """
    tracer = Tracer(fn, tuple(slots), tuple(slot_names), root=root, fullgraph=fullgraph)
    return tracer.run(call if call is not None else (lambda: fn(*slots)))


# ---------------------------------------------------------------------------
# Where the user is


_PACKAGE_DIRS = (
    os.path.join(os.path.dirname(torch.__file__), ""),
    os.path.join(os.path.dirname(os.path.abspath(__file__)), ""),
)
_STDLIB_DIR = os.path.join(os.path.dirname(contextlib.__file__), "")


def _is_library_file(filename: str) -> bool:
    if filename.startswith("<"):
        return filename.startswith(("<frozen", "<nnscaler graph"))
    if filename.startswith(_PACKAGE_DIRS):
        return True
    # Third-party packages under the interpreter's lib dir are the user's models.
    return filename.startswith(_STDLIB_DIR) and "-packages" not in filename


def user_location() -> tuple[str, int]:
    """The innermost frame outside torch, nnscaler_eval and the standard library."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library_file(filename):
            return filename, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>", 0


def _record_source(node: fx.Node) -> None:
    """Tag `node` with the user's line that produced it.

    `nnscaler_source` (filename, lineno) for the runner's comments; `source_loc`
    ("file:line") and `stack_trace` (one traceback entry, the format torch.fx and
    Dynamo use) for exported graphs and fx's own printing.
    """
    frame = sys._getframe(1)
    while frame is not None and _is_library_file(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        node.meta["nnscaler_source"] = ("<unknown>", 0)
        return
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    node.meta["nnscaler_source"] = (filename, lineno)
    node.meta["source_loc"] = f"{filename}:{lineno}"
    line = linecache.getline(filename, lineno).strip()
    node.meta["stack_trace"] = (
        f'  File "{filename}", line {lineno}, in {frame.f_code.co_name}\n'
        + (f"    {line}\n" if line else "")
    )


# ---------------------------------------------------------------------------
# Classifying torch calls

# Values that go into the graph as literals.
_LITERAL_TYPES = (
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
_SHAPE_QUERIES = frozenset({"size", "shape", "numel", "nelement", "__len__", "stride"})
# Ops whose output shape depends on input *values*.
_DATA_DEPENDENT_SHAPE_OPS = frozenset(
    {
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
        "_unique",
        "_unique2",
        "bincount",
        "repeat_interleave",
        "nonzero_static",
    }
)
# Tensor methods that hand tensor data to Python.
_DATA_ACCESS = {
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
_STATE_CHANGES = frozenset({trace_patches.REAL_SET_GRAD_ENABLED})

# Tensor dunders -> (operator function, reflected?)
_OPERATORS: dict[str, tuple[Callable[..., Any], bool]] = {}
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
    _OPERATORS[f"__{_dunder}__"] = (_fn, False)
    _OPERATORS[f"__r{_dunder}__"] = (_fn, True)
for _dunder, _fn in _OTHER_DUNDERS:
    _OPERATORS[f"__{_dunder}__"] = (_fn, False)
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
        dir(torch.Tensor), key=lambda n: (n.startswith("__"), n not in _OPERATORS, n)
    ):
        try:
            value = getattr(torch.Tensor, name)
            names.setdefault(value, name)
        except (AttributeError, TypeError):  # unhashable or odd class attributes
            continue
    return names


_TENSOR_ATTRIBUTE_NAMES = _tensor_attribute_names()


def _classify(func: Callable[..., Any]) -> tuple[str, Any]:
    """How a torch call is written in the graph.

    ("getattr" | "setattr", attribute name): a tensor property read / write;
    ("operator", dunder name): a Tensor dunder, written as the Python operator;
    ("method", name): a Tensor method, written `x.name(...)`;
    ("function", func): anything else, called as a function.
    """
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__") and type(func).__name__ == "method-wrapper":
        descriptor = getattr(func, "__self__", None)
        attr = getattr(descriptor, "__name__", None) or getattr(
            getattr(descriptor, "fget", None), "__name__", None
        )
        if attr is not None:
            return ("getattr" if name == "__get__" else "setattr"), attr
    try:
        attribute = _TENSOR_ATTRIBUTE_NAMES.get(func)
    except TypeError:  # unhashable callable
        attribute = None
    if attribute is not None:
        if attribute in _OPERATORS:
            return "operator", attribute
        return "method", attribute
    return "function", func


def _qualname(func: Callable[..., Any]) -> str:
    kind, target = _classify(func)
    if kind != "function":
        return f"Tensor.{target}"
    module = getattr(func, "__module__", None) or ""
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func))
    return f"{module}.{name}" if module else name


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Tensors inside the containers a torch call can take or return (not objects)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, slice):
        yield from _tensors_in((value.start, value.stop, value.step))


def _holds_tensor(obj: Any, depth: int = 0, seen: Optional[set[int]] = None) -> bool:
    """Does a non-pytree object carry tensors, at any depth of its attributes, lists,
    tuples and dicts (an HF `DynamicCache` holds them in a list of layer objects)?
    Modules, functions, classes and Python modules are not looked into."""
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 8 or isinstance(obj, (*_LITERAL_TYPES, nn.Module, type, types.FunctionType,
                                     types.ModuleType, types.MethodType)):
        return False
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, (tuple, list, set, frozenset)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, dict):
            return False
        items = attributes.values()
    return any(_holds_tensor(item, depth + 1, seen) for item in list(items))


def _hidden_tensors(leaf: Any) -> bool:
    """A pytree leaf that carries tensors the graph could not take as inputs."""
    return (not isinstance(leaf, (torch.Tensor, *_LITERAL_TYPES, nn.Module))
            and _holds_tensor(leaf))


def _hidden_tensors_reason(slot_name: str, leaf: Any) -> str:
    return (f"input {slot_name!r} holds tensors inside a {type(leaf).__name__}, which is "
            "not a pytree container (register it with torch.utils._pytree)")


def input_fallback(fn: Callable[..., Any], slots: tuple[Any, ...],
                   slot_names: tuple[str, ...]) -> Optional[tuple[Fallback, type]]:
    """Why these arguments cannot be graph inputs (tensors inside non-pytree objects,
    such as an HF KV cache), found before anything runs, with the type of the object
    at fault; None when they can."""
    for slot, slot_name in zip(slots, slot_names):
        for leaf in pytree.tree_leaves(slot):
            if _hidden_tensors(leaf):
                code = getattr(fn, "__code__", None)
                where = (code.co_filename, code.co_firstlineno) if code else ("<unknown>", 0)
                return Fallback(_hidden_tensors_reason(slot_name, leaf), *where), type(leaf)
    return None


def _has_call_hooks(module: nn.Module) -> bool:
    """Would `nn.Module._call_impl` run any hook for this module?"""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or getattr(module, "_forward_hooks_with_kwargs", None)
        or getattr(module, "_forward_hooks_always_called", None)
        or getattr(module, "_forward_pre_hooks_with_kwargs", None)
        or module_globals._global_forward_hooks
        or module_globals._global_forward_pre_hooks
        or module_globals._global_backward_hooks
        or module_globals._global_backward_pre_hooks
        or getattr(module_globals, "_global_forward_hooks_always_called", None)
        or getattr(module_globals, "_global_forward_hooks_with_kwargs", None)
    )


class _RecordingAborted(Exception):
    """Internal: a graph break happened while building a node; stop recording it."""


class _CondNotCapturable(Exception):
    """Internal: a torch.cond branch cannot be captured; carries the reason and line."""

    def __init__(self, fallback: Fallback) -> None:
        super().__init__(str(fallback))
        self.fallback = fallback


class _BranchFrame:
    """The graph of one torch.cond branch while it is traced.

    Its placeholders are the operands (`inputs`) and the values of the enclosing graph
    it reads (`lifted`: enclosing node -> placeholder; `lifted_values`: that node's
    value in the run, used for the real run of the taken branch).
    """

    def __init__(self, graph: fx.Graph, parent_graph: fx.Graph, parent: Optional[_BranchFrame]):
        self.graph = graph
        self.parent_graph = parent_graph
        self.parent = parent
        self.inputs: list[fx.Node] = []
        self.lifted: dict[fx.Node, fx.Node] = {}
        self.lifted_values: dict[fx.Node, Any] = {}
        self.attrs: dict[str, Any] = {}  # get_attr targets of this graph (nested branches)

    def add_input(self, name: str) -> fx.Node:
        node = self.graph.placeholder(_identifier(name))
        self.inputs.append(node)
        return node

    def lift(self, outer: fx.Node, value: Any) -> fx.Node:
        placeholder = self.lifted.get(outer)
        if placeholder is None:
            # Placeholder order does not matter yet: `_BranchTrace.finish` rebuilds it.
            placeholder = self.graph.placeholder(_identifier(outer.name))
            self.lifted[outer] = placeholder
            self.lifted_values[outer] = value
        return placeholder


@dataclass
class _BranchTrace:
    frame: _BranchFrame
    out_spec: pytree.TreeSpec
    out_meta: list[tuple[Any, ...]]
    entry_grad_mode: bool

    def finish(self, operands: int, lifted: list[fx.Node], class_name: str) -> fx.GraphModule:
        """The branch as a GraphModule taking (*operands, *lifted), in that order, and
        returning a flat tuple of tensors (as torch.ops.higher_order.cond wants)."""
        frame = self.frame
        graph = fx.Graph()
        val_map: dict[fx.Node, fx.Node] = {}
        params = []
        for old in frame.inputs[:operands]:
            val_map[old] = new = graph.placeholder(old.name)
            params.append(new)
        for outer in lifted:
            old = frame.lifted.get(outer)
            new = graph.placeholder(old.name if old is not None else _identifier(outer.name))
            if old is not None:
                val_map[old] = new
            params.append(new)
        for index, param in enumerate(params):
            param.meta["nnscaler_input"] = InputPath(index, ())
        graph.output(graph.graph_copy(frame.graph, val_map))
        graph.lint()
        # Not lazy: its forward's code object must exist now, to be marked as never a
        # capture target (a backend running the cond HOP calls it inside compiled code).
        gm = fx.GraphModule(dict(frame.attrs), graph, class_name=class_name)
        _C.mark_skip(type(gm).forward.__code__)
        release_source_with(gm)
        gm.meta["nnscaler_entry_grad_mode"] = self.entry_grad_mode
        return gm


def _tensor_meta(tensor: torch.Tensor) -> tuple[Any, ...]:
    """(shape, dtype, device, requires_grad, stride); call with torch function disabled."""
    return (
        tuple(tensor.shape),
        tensor.dtype,
        tensor.device,
        tensor.requires_grad,
        tuple(tensor.stride()),
    )


def _fresh_fake(meta: tuple[Any, ...]) -> torch.Tensor:
    """A new tensor with `meta` (call inside the fake mode, torch function disabled)."""
    shape, dtype, device, requires_grad, stride = meta
    return torch.empty_strided(
        shape, stride, dtype=dtype, device=device, requires_grad=requires_grad
    )


def _parameter_names(fn: Callable[..., Any], count: int) -> Optional[list[str]]:
    """The first `count` positional parameter names of `fn` (branch placeholders)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    names = [
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return names[:count] if len(names) >= count else None


_AUTOCAST_DEVICES = ("cpu", "cuda")
_MISSING = object()


def _module_state(module: nn.Module) -> dict[str, tuple[Any, Any]]:
    """What `self.x = ...` and friends can change: each attribute's object, and for a
    container attribute (the `_parameters` / `_buffers` / `_modules` / hook dicts, user
    lists and dicts) the objects inside it, one level deep."""
    state: dict[str, tuple[Any, Any]] = {}
    for name, value in module.__dict__.items():
        if name == "training":
            continue
        if isinstance(value, dict):
            contents: Any = tuple((k, v) for k, v in value.items())
        elif isinstance(value, (list, set)):
            contents = tuple(value)
        else:
            contents = None
        state[name] = (value, contents)
    return state


def _pop_modes_to(depth: int) -> None:
    """Pop torch function modes until `depth` are left (idempotent)."""
    while torch._C._len_torch_function_stack() > depth:
        torch._C._pop_torch_function_stack()


def _global_hook_state() -> tuple[Any, ...]:
    """The global module hooks, by identity (a change means another graph)."""
    return tuple(tuple(d.items()) for _, d in global_hook_items())


def _same_state(
    before: dict[str, tuple[Any, Any]], after: dict[str, tuple[Any, Any]]
) -> Optional[str]:
    """The first attribute that differs between two `_module_state`s, or None."""
    for name in before.keys() | after.keys():
        if name not in before or name not in after:
            return name
        (old, old_contents), (new, new_contents) = before[name], after[name]
        if old is not new:
            return name
        if old_contents is None:
            continue
        if len(old_contents) != len(new_contents):
            return name
        for a, b in zip(old_contents, new_contents):
            if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == 2 == len(b):
                if a[0] != b[0] or a[1] is not b[1]:
                    return name
            elif a is not b:
                return name
    return None


# ---------------------------------------------------------------------------
# The tracer


class Tracer(TorchFunctionMode):
    """Records one real run of a forward into an fx graph (see module docstring)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        slots: tuple[Any, ...],
        slot_names: tuple[str, ...],
        *,
        root: Optional[nn.Module],
        fullgraph: bool,
    ) -> None:
        super().__init__()
        if len(slots) != len(slot_names):
            raise ValueError(f"{len(slots)} slots but {len(slot_names)} slot names")
        self.fn = fn
        self.slots = slots
        self.slot_names = slot_names
        self.root = root
        self.fullgraph = fullgraph
        self.graph = fx.Graph()  # the graph being recorded into (a cond branch's, inside one)
        self._root_graph = self.graph
        self.fallback: Optional[Fallback] = None
        # Inside a torch.cond branch: its frame, and the fake mode its values live in.
        self._branch: Optional[_BranchFrame] = None
        self._fake_mode: Optional[FakeTensorMode] = None
        self._branch_names = itertools.count()
        self._suspended = 0

        # Tensor identity -> node; every tensor seen is kept alive so ids stay unique.
        self._tensor_nodes: dict[int, fx.Node] = {}
        self._keepalive: list[Any] = []
        self._dynamic_shape: set[int] = set()
        # get_attr / call_module targets -> objects, for the GraphModule and the runner.
        self._attr_values: dict[str, Any] = {}
        self._attr_nodes: dict[str, fx.Node] = {}
        self._constant_ids: dict[int, str] = {}
        self._constant_counter = itertools.count()
        self._module_targets: dict[str, str] = {}  # GraphModule target -> path from root

        # The root's tree, by identity.
        self._module_paths: dict[int, str] = {}
        self._param_paths: dict[int, str] = {}
        if root is not None:
            for name, module in root.named_modules(remove_duplicate=False):
                self._module_paths.setdefault(id(module), name)
            for name, parameter in root.named_parameters(remove_duplicate=False):
                self._param_paths.setdefault(id(parameter), name)
            for name, buffer in root.named_buffers(remove_duplicate=False):
                self._param_paths.setdefault(id(buffer), name)

        # Training flags: id(module) -> (module, original value, flag). `_live` holds
        # those `module.training` answers with on this thread now (trace_patches'
        # descriptor asks read_training); module `__dict__`s keep their real bools.
        self._swapped: dict[int, tuple[nn.Module, Any, TrainingFlag]] = {}
        self._live: dict[int, tuple[nn.Module, Any, TrainingFlag]] = {}
        self._flag_nodes: dict[int, fx.Node] = {}
        self._training_inputs: list[nn.Module] = []
        self._branched: dict[int, tuple[nn.Module, bool]] = {}
        self._visited: dict[int, nn.Module] = {}
        self._snapshots: dict[int, dict[str, tuple[Any, Any]]] = {}
        self._opaque: dict[int, nn.Module] = {}

        self._last_placeholder: Optional[fx.Node] = None
        self._example_inputs: list[Any] = []
        self.read_metadata = False

        # Global torch state as the graph sees it, versus as the run has it.
        self._entry_grad_mode = torch.is_grad_enabled()
        self._graph_grad_mode = self._entry_grad_mode
        self._entry_inference_mode = torch.is_inference_mode_enabled()
        self._entry_autocast = {d: self._autocast_state(d) for d in _AUTOCAST_DEVICES}
        self._graph_autocast = dict(self._entry_autocast)
        self._open_autocast: dict[str, fx.Node] = {}

    # -- state -----------------------------------------------------------------

    @property
    def recording(self) -> bool:
        return self.fallback is None and self._suspended == 0

    def graph_break(self, reason: str, location: Optional[tuple[str, int]] = None) -> None:
        """End the capture: record why (first reason wins), or raise with fullgraph."""
        if self.fallback is not None:
            return
        filename, lineno = location if location is not None else user_location()
        if self._branch is not None:
            # Stop tracing the branch now (it runs on fake tensors; nothing is lost):
            # trace_cond turns this into the frame's fallback, or its parent branch's.
            fallback = Fallback(f"in a torch.cond branch: {reason}", filename, lineno)
            raise _CondNotCapturable(fallback)
        self.fallback = Fallback(reason, filename, lineno)
        if self.fullgraph:
            raise GraphBreakError(self.fallback)
        # From here on the run is plain eager: give modules their real flags back.
        self._restore_training()

    @contextlib.contextmanager
    def suspended(self, modules: tuple[nn.Module, ...] = ()) -> Iterator[None]:
        """Run code for real without recording it (opaque modules, register_op ops).

        `modules` get their real `training` values back meanwhile, so flags do not
        leak into code that is not being recorded.
        """
        self._suspended += 1
        hidden = {}
        for module in modules:
            entry = self._live.pop(id(module), None)
            if entry is not None:
                hidden[id(module)] = entry
        # Code run for real here shapes no graph: the functions it runs are not
        # recorded for value guards (a hook appending to a list would otherwise be
        # guarded and recapture on every call).
        paused = _C.record_functions_pause()
        try:
            yield
        finally:
            _C.record_functions_resume(paused)
            if self.fallback is None:
                self._live.update(hidden)
            self._suspended -= 1

    # -- the run -----------------------------------------------------------------

    def run(self, call: Callable[[], Any]) -> Capture:
        """Trace `call()` once; the process is as before afterwards, however it ends.

        An asynchronous exception (KeyboardInterrupt from a signal handler) may land
        between any two bytecodes, in here, in the patches, in the user's forward or in
        a `finally`. So every step that changes process state is undone by one
        idempotent `_leave()`, run in the outer `finally` and run again if an interrupt
        lands inside it: no patch, no current tracer, no mode of ours on the torch
        function stack, nothing of the trace pinned.
        """
        previous = current_tracer()
        mode_depth = torch._C._len_torch_function_stack()
        lazy_flag = _lazy_graph_module._use_lazy_graph_module_flag
        global_hooks = _global_hook_state()
        try:
            set_current_tracer(self)
            trace_patches.install(self)
            self._prepare()
            # `with self:`, except that leaving pops down to the entry depth: an
            # interrupt inside `_pop_mode_temporarily` can leave our mode popped
            # already, and a plain pop would then fail or pop somebody else's.
            torch._C._push_on_torch_function_stack(self)
            try:
                result = call()
            finally:
                _pop_modes_to(mode_depth)
            self._check_module_state()
            layout = self._record_output(result) if self.fallback is None else None
            self._leave(previous, mode_depth)
            capture = self._make_capture(result, layout)
            capture.state_unchanged = self._unchanged_check(global_hooks)  # type: ignore[attr-defined]
            return capture
        finally:
            run_to_completion(self._leave, previous, mode_depth, lazy_flag, True)

    def _unchanged_check(self, global_hooks: Any) -> Callable[[], bool]:
        """A check that the modules the trace went through, and the global hooks, are
        still as the trace saw them (hooks, the module tree, attributes).

        Another thread may change them while this one captures; the C entry snapshots
        its guarded dicts' versions only when convert_frame builds it, after the trace.
        convert_frame calls this once the entry exists: a change in between makes the
        entry wrong yet valid by its versions, so it is dropped (the call's result
        stands; the next call captures again).
        """
        visited, snapshots = dict(self._visited), dict(self._snapshots)
        inside_opaque = {id(m) for o in self._opaque.values() for m in o.modules()}

        def unchanged() -> bool:
            if _global_hook_state() != global_hooks:
                return False
            return all(
                _same_state(snapshots[key], _module_state(module)) is None
                for key, module in visited.items()
                if key not in inside_opaque
            )

        return unchanged

    def _leave(
        self, previous: Any, mode_depth: int, lazy_flag: Any = None, final: bool = False
    ) -> None:
        """Undo what run() did to the process; each step idempotent."""
        self._restore_training()
        trace_patches.uninstall(self)
        # Modes pushed above run()'s entry depth (ours, or one an interrupt left).
        _pop_modes_to(mode_depth)
        if current_tracer() is self:
            set_current_tracer(previous)
        if lazy_flag is not None:
            _lazy_graph_module._use_lazy_graph_module_flag = lazy_flag
        if final:
            # An exception's traceback may keep this tracer alive: not its tensors.
            self._tensor_nodes.clear()
            self._keepalive.clear()

    def _prepare(self) -> None:
        # Placeholders: every tensor leaf of the slots.
        for index, (slot, slot_name) in enumerate(zip(self.slots, self.slot_names)):
            leaves = pytree.tree_flatten_with_path(slot)[0]
            for keys, leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    name = slot_name + "".join(_key_suffix(k) for k in keys)
                    node = self._placeholder(name)
                    node.meta["nnscaler_input"] = InputPath(index, tuple(keys))
                    self._example_inputs.append(leaf)
                    if id(leaf) not in self._tensor_nodes:
                        self._map(leaf, node)
                elif _hidden_tensors(leaf):
                    self.graph_break(_hidden_tensors_reason(slot_name, leaf),
                                     location=self._forward_location())
                    return
        # Flags for the whole tree, not only for the modules called: a parent may read
        # a child's flag (`if self.block.training:`) without calling it.
        if self.root is not None:
            for module in self.root.modules():
                self._swap_training(module)
            self._visit(self.root)

    def _forward_location(self) -> tuple[str, int]:
        code = getattr(self.fn, "__code__", None)
        if code is None:
            return "<unknown>", 0
        return code.co_filename, code.co_firstlineno

    def _swap_training(self, module: nn.Module) -> None:
        """From now on `module.training` reads as a TrainingFlag on this thread only
        (trace_patches' descriptor asks read_training); its `__dict__` is untouched."""
        if id(module) in self._swapped or self.fallback is not None:
            return
        current = module.__dict__.get("training", _MISSING)
        if current is _MISSING:
            return
        value = current.value if isinstance(current, TrainingFlag) else bool(current)
        flag = TrainingFlag(value, module, self)
        entry = (module, current, flag)
        self._swapped[id(module)] = entry
        if trace_patches.training_is_ours(module):
            self._live[id(module)] = entry
        else:
            # A class of it defines `training` itself, shadowing the descriptor: reads
            # cannot be told apart from branches, so the graph is valid for this value.
            self.note_branch(module, value)

    def read_training(self, module: nn.Module, value: Any) -> Any:
        """`module.training` on this thread (trace_patches' descriptor): its flag while
        this trace records it, else `value`, the real `__dict__` entry."""
        entry = self._live.get(id(module))
        if entry is None or entry[0] is not module or entry[1] is not value:
            return value  # not ours, hidden (suspended), or written since the swap
        return entry[2]

    def _restore_training(self) -> None:
        # One C-level operation: an interrupt cannot leave it half done.
        self._live.clear()

    def _visit(self, module: nn.Module) -> None:
        if id(module) in self._visited:
            return
        self._swap_training(module)
        self._visited[id(module)] = module
        self._snapshots[id(module)] = _module_state(module)

    def _check_module_state(self) -> None:
        """Catch state writes the `__setattr__` patch cannot see (`object.__setattr__`,
        `__dict__` updates, mutated attribute containers)."""
        if self.fallback is not None:
            return
        inside_opaque: set[int] = set()
        for module in self._opaque.values():
            inside_opaque.update(id(m) for m in module.modules())
        for key, module in self._visited.items():
            if key in inside_opaque:
                continue  # an opaque module runs for real on every call
            changed = _same_state(self._snapshots[key], _module_state(module))
            if changed is not None:
                self.graph_break(
                    f"write to module state: {type(module).__name__}.{changed} changed "
                    "during forward",
                    location=self._forward_location(),
                )
                return

    # -- callbacks from trace_patches, runtime.ifexpr, register_op --------------

    def on_module_call(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        self._visit(module)
        if (
            _has_call_hooks(module)
            or getattr(module, "_compiled_call_impl", None) is not None
            or isinstance(module, torch.jit.ScriptModule)  # its ops run in C++, unseen
        ):
            if self._branch is not None:  # it would run for real, on fake tensors
                self.graph_break(
                    f"a submodule with hooks ({type(module).__name__}) cannot be called in "
                    "a torch.cond branch"
                )
            return self._call_opaque_module(module, args, kwargs)
        return trace_patches.original_module_call(module, *args, **kwargs)

    def on_module_setattr(self, module: nn.Module, name: str) -> None:
        if id(module) in self._module_paths or id(module) in self._visited:
            self.graph_break(f"write to module state: {type(module).__name__}.{name} = ...")

    def on_python_side_effect(self, what: str) -> None:
        self.graph_break(what)

    def note_branch(self, module: nn.Module, value: bool) -> None:
        """Python branched on `module.training`: the graph is valid for `value` only."""
        self._branched.setdefault(id(module), (module, value))

    def specialise_number(self, number: _TrackedNumber) -> None:
        """A tracked number was used as a plain Python value."""
        if number.tracer is not self:
            return
        if getattr(number, "data_dependent", False):
            self.graph_break(
                "data-dependent value: a Python number computed from tensors "
                "by an opaque op was used in Python"
            )
            return
        for module in number.deps:
            self.note_branch(module, self._flag_value(module))

    def trace_ifexpr(self, cond: Any, true_value: Any, false_value: Any) -> Any:
        """`ifexpr(cond, t, f)` under this tracer (called by nnscaler_eval.runtime)."""
        if not (self.recording and isinstance(cond, TrainingFlag) and cond.tracer is self):
            return true_value if cond else false_value
        module, value = cond.module, cond.value
        chosen = true_value if value else false_value
        try:
            if _same_tensor_kind(true_value, false_value):
                node = self._ifexpr_node(module, true_value, false_value)
                with self.suspended():
                    alias = chosen.view_as(chosen)
                # A fresh alias stands for the ifexpr: the chosen tensor itself keeps
                # its own node for its other uses.
                self._map(alias, node, dynamic=id(chosen) in self._dynamic_shape)
                return alias
            if _is_number(true_value) and _is_number(false_value):
                node = self._ifexpr_node(module, true_value, false_value)
                deps = (module,) + _deps_of(true_value) + _deps_of(false_value)
                return _tracked(quiet_plain(chosen), node, _unique_modules(deps), self)
        except _RecordingAborted:
            return chosen
        # Anything else (None, strings, tensors of different shapes): specialise.
        self.note_branch(module, value)
        return chosen

    def call_with_flags(
        self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Record a C function that got a flag for a `bool` parameter (trace_patches).

        Its argument parser would reject the flag before torch function dispatch, so
        trace_patches routes such calls here: recorded with the flag as a graph input,
        run with the plain bool.
        """
        stack = torch.overrides._get_current_function_mode_stack()
        if not stack or stack[-1] is not self:
            # Another mode sits above ours; it would see a plain bool: specialise.
            return function(
                *[plain_value(a) for a in args], **{k: plain_value(v) for k, v in kwargs.items()}
            )
        with torch.overrides._pop_mode_temporarily():
            return self.__torch_function__(function, (), args, kwargs)

    def trace_cond(
        self,
        original: Callable[..., Any],
        pred: Any,
        true_fn: Callable[..., Any],
        false_fn: Callable[..., Any],
        operands: Any,
    ) -> Any:
        """`torch.cond` under this tracer (trace_patches routes it here).

        A Python predicate (a shape test) picks a branch in Python, which is traced
        inline. A tensor predicate, or `self.training`, becomes ONE node
        `torch.ops.higher_order.cond(pred, true_graph_k, false_graph_k, operands)`
        whose branches are GraphModules (attributes of the captured one), so one graph
        serves both outcomes.

        Design note, tracing both branches safely: each branch is traced on fresh fake
        tensors (FakeTensorMode) standing for the operands, and any real tensor it
        reads from a closure (parameters, earlier results) is handed to ops as a fake
        and becomes an explicit input of both branches (torch.cond's "closures become
        explicit inputs"). So no op of either branch touches real data: the untaken
        branch has no effect. A branch that would mutate an input or closure, branch
        on tensor data, call a module with hooks, or do anything else the tracer
        refuses stops at once; the frame then falls back (reason and branch line) and
        torch.cond runs for real. Only when both branches are captured does the real
        run happen: the taken branch's graph on the real values, once.
        """
        tracked_pred = isinstance(pred, TrainingFlag) and pred.tracer is self
        if self.recording and not (isinstance(pred, torch.Tensor) or tracked_pred):
            return true_fn(*operands) if plain_value(pred) else false_fn(*operands)
        if self.recording:
            try:
                return self._record_cond(pred, true_fn, false_fn, operands)
            except _CondNotCapturable as exc:
                if self._branch is not None:
                    raise  # the enclosing branch is not capturable either
                self.graph_break(exc.fallback.reason, (exc.fallback.filename, exc.fallback.lineno))
            except _RecordingAborted:
                pass  # graph_break already recorded why
        stack = torch.overrides._get_current_function_mode_stack()
        if stack and stack[-1] is self:
            with torch.overrides._pop_mode_temporarily():
                return original(pred, true_fn, false_fn, operands)
        return original(pred, true_fn, false_fn, operands)

    def _record_cond(
        self,
        pred: Any,
        true_fn: Callable[..., Any],
        false_fn: Callable[..., Any],
        operands: Any,
    ) -> Any:
        where = user_location()

        def refuse(reason: str) -> _CondNotCapturable:
            return _CondNotCapturable(Fallback(f"torch.cond: {reason}", *where))

        if isinstance(pred, torch.Tensor):
            with torch._C.DisableTorchFunction():
                if pred.numel() != 1:
                    raise refuse(f"the predicate has {pred.numel()} elements, not one")
        if not isinstance(operands, (tuple, list)):
            raise refuse(f"operands must be a tuple or list, not {type(operands).__name__}")
        leaves, in_spec = pytree.tree_flatten(tuple(operands))
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                raise refuse(f"an operand is a {type(leaf).__name__}; only tensors are captured")
        self._sync_global_state()  # branches start from the run's grad / autocast state
        pred_arg = self._graph_arg(pred)
        operand_args = [self._graph_arg(leaf) for leaf in leaves]

        fake_mode = self._fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
        k = next(self._branch_names)  # outer branches get the lower numbers
        true_trace = self._trace_branch("true", true_fn, leaves, in_spec, fake_mode, where)
        false_trace = self._trace_branch("false", false_fn, leaves, in_spec, fake_mode, where)
        if true_trace.out_spec != false_trace.out_spec:
            raise refuse(
                f"the branches return different structures ({true_trace.out_spec} vs "
                f"{false_trace.out_spec})"
            )
        for i, (a, b) in enumerate(zip(true_trace.out_meta, false_trace.out_meta)):
            if a[:3] != b[:3]:
                raise refuse(f"output {i} differs between the branches: {a[:3]} vs {b[:3]}")

        # Both branches take the operands, then every value either one lifted.
        lifted: dict[fx.Node, Any] = dict(true_trace.frame.lifted_values)
        for node, value in false_trace.frame.lifted_values.items():
            lifted.setdefault(node, value)
        modules = [
            trace.finish(len(leaves), list(lifted), _class_name(f"{name}_graph_{k}"))
            for trace, name in ((true_trace, "true"), (false_trace, "false"))
        ]
        attrs = [
            self._branch_attr(f"{name}_graph_{k}", gm)
            for name, gm in zip(("true", "false"), modules)
        ]
        node = self._create_node(
            "call_function",
            torch.ops.higher_order.cond,
            (pred_arg, attrs[0], attrs[1], (*operand_args, *lifted)),
            {},
        )

        if self._branch is None:
            # The real run: the taken branch's graph on the real values, once.
            if isinstance(pred, torch.Tensor):
                with torch._C.DisableTorchFunction():
                    taken = bool(pred)
            else:
                taken = quiet_plain(pred)
            with self.suspended():
                flat = list(modules[0 if taken else 1](*leaves, *lifted.values()))
                for i, value in enumerate(flat):
                    if id(value) in self._tensor_nodes:  # an input passed through
                        flat[i] = value.view_as(value)
        else:
            # Nested in a branch being traced: stand-ins with the outputs' metadata.
            with torch._C.DisableTorchFunction(), contextlib.ExitStack() as stack:
                stack.enter_context(fake_mode)
                flat = [_fresh_fake(meta) for meta in true_trace.out_meta]
                # Results of an op, not leaves (a leaf that requires grad refuses in-place ops).
                flat = [t.clone() if t.requires_grad else t for t in flat]
        self._bind_result(tuple(flat), node, dynamic=False)
        return pytree.tree_unflatten(flat, true_trace.out_spec)

    def _trace_branch(
        self,
        which: str,
        fn: Callable[..., Any],
        leaves: list[torch.Tensor],
        in_spec: pytree.TreeSpec,
        fake_mode: FakeTensorMode,
        where: tuple[str, int],
    ) -> _BranchTrace:
        """Record `fn(*operands)` into a graph of its own, on fake operands."""
        frame = _BranchFrame(fx.Graph(), self.graph, self._branch)
        saved = (
            self.graph,
            self._branch,
            self._fake_mode,
            self._graph_grad_mode,
            self._graph_autocast,
            self._entry_autocast,
            self._open_autocast,
        )
        entry_grad_mode = self._graph_grad_mode
        self.graph, self._branch, self._fake_mode = frame.graph, frame, fake_mode
        self._graph_autocast = dict(self._graph_autocast)
        self._entry_autocast = dict(self._graph_autocast)
        self._open_autocast = {}
        flat_operands = in_spec == pytree.tree_flatten(tuple(leaves))[1]
        names = _parameter_names(fn, len(leaves)) if flat_operands else None
        try:
            with contextlib.ExitStack() as stack:
                if saved[2] is None:
                    stack.enter_context(fake_mode)
                with torch._C.DisableTorchFunction():
                    fakes = [_fresh_fake(_tensor_meta(leaf)) for leaf in leaves]
                for i, fake in enumerate(fakes):
                    self._map(fake, frame.add_input(names[i] if names else f"arg{i}"))
                out = fn(*pytree.tree_unflatten(fakes, in_spec))
                out_leaves, out_spec = pytree.tree_flatten(out)
                for leaf in out_leaves:
                    if not isinstance(leaf, torch.Tensor):
                        self.graph_break(
                            f"the branch returns a {type(leaf).__name__}; "
                            "only tensors are captured"
                        )
                out_nodes = [self._graph_arg(leaf) for leaf in out_leaves]
                self._sync_global_state()
                if self._open_autocast:
                    self.graph_break("the branch leaves autocast changed")
                with torch._C.DisableTorchFunction():
                    out_meta = [_tensor_meta(leaf) for leaf in out_leaves]
            frame.graph.output(tuple(out_nodes))
        except (_CondNotCapturable, GraphBreakError):
            raise
        except _RecordingAborted:
            raise _CondNotCapturable(
                Fallback(f"torch.cond: the {which} branch could not be recorded", *where)
            ) from None
        except Exception as exc:  # the branch cannot run on fake tensors
            name = getattr(fn, "__qualname__", None) or repr(fn)
            raise _CondNotCapturable(
                Fallback(
                    f"torch.cond: the {which} branch {name} cannot be traced "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                    *where,
                )
            ) from exc
        finally:
            (
                self.graph,
                self._branch,
                self._fake_mode,
                self._graph_grad_mode,
                self._graph_autocast,
                self._entry_autocast,
                self._open_autocast,
            ) = saved
        return _BranchTrace(frame, out_spec, out_meta, entry_grad_mode)

    def _branch_attr(self, name: str, gm: fx.GraphModule) -> fx.Node:
        """A get_attr node for a branch GraphModule, in the graph being recorded."""
        if self._branch is None:
            while name in self._attr_values:
                name += "_"
            return self._get_attr(name, gm)
        self._branch.attrs[name] = gm
        return self.graph.get_attr(name)

    def _local(self, node: fx.Node, value: Any) -> fx.Node:
        """`node` as a value of the graph being recorded: inside a cond branch, a value
        of an enclosing graph becomes an input of the branch (lifted, level by level)."""
        if node.graph is self.graph:
            return node
        chain = []
        frame = self._branch
        while frame is not None and frame.graph is not node.graph:
            chain.append(frame)
            frame = frame.parent
        if frame is None and node.graph is not self._root_graph:
            reason = "a value computed inside a torch.cond branch is used outside it"
            self.graph_break(reason)
            # It is a fake tensor: running on with it would compute garbage.
            raise RuntimeError(f"{reason} (torch.cond branches must not leak values)")
        for frame in reversed(chain):
            node = frame.lift(node, value)
        return node

    def _fakeify(self, value: Any) -> Any:
        """Inside a cond branch, real tensors as fakes: no op of a branch touches real
        data (FakeTensorMode would otherwise run in-place ops on real inputs)."""
        if self._fake_mode is None:
            return value
        if isinstance(value, torch.Tensor):
            if isinstance(value, FakeTensor):
                return value
            return self._fake_mode.from_tensor(value)
        if isinstance(value, (tuple, list)):
            items = [self._fakeify(v) for v in value]
            if isinstance(value, list):
                return items
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, dict):
            return {k: self._fakeify(v) for k, v in value.items()}
        return value

    def _call_in_branch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one op of a cond branch on fakes, refusing mutation of its inputs."""
        call_args = self._fakeify(quiet_plain(args))
        call_kwargs = self._fakeify(quiet_plain(kwargs))
        inputs = list(_tensors_in((call_args, call_kwargs)))
        with torch._C.DisableTorchFunction():
            versions = [t._version for t in inputs]
        result = func(*call_args, **call_kwargs)
        with torch._C.DisableTorchFunction():
            changed = [t for t, v in zip(inputs, versions) if t._version != v]
        for tensor in changed:
            node = self._tensor_nodes.get(id(tensor))
            if node is None or node.graph is not self.graph or node.op == "placeholder":
                self.graph_break(
                    f"{_qualname(func)} mutates an input or closure of the branch "
                    "(torch.cond branches must not)"
                )
        return result

    def call_opaque(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run `fn` for real as ONE graph node (ops registered with `register_op`)."""
        if not self.recording:
            return fn(*args, **kwargs)
        try:
            node_args, node_kwargs = self._graph_arg(args), self._graph_arg(kwargs)
        except _RecordingAborted:
            return fn(*args, **kwargs)
        with self.suspended():
            result = fn(*self._fakeify(quiet_plain(args)), **self._fakeify(quiet_plain(kwargs)))
        inputs_have_tensors = next(_tensors_in((args, kwargs)), None) is not None
        deps = _unique_modules(_deps_of_args((args, kwargs)))
        try:
            if next(_tensors_in(result), None) is not None or result is None:
                node = self._create_node("call_function", fn, node_args, node_kwargs)
                self._bind_result(result, node, dynamic=False)
                return result
            if _is_number(result):
                node = self._create_node("call_function", fn, node_args, node_kwargs)
                number = _tracked(result, node, deps, self)
                number.data_dependent = inputs_have_tensors  # type: ignore[attr-defined]
                return number
        except _RecordingAborted:
            return result
        if inputs_have_tensors:
            self.graph_break(
                f"data-dependent value: {_qualname(fn)}() returned a "
                f"{type(result).__name__} computed from tensors"
            )
        else:
            for module in deps:
                self.note_branch(module, self._flag_value(module))
        return result

    # -- TorchFunctionMode ---------------------------------------------------------

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Optional[dict[str, Any]] = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if not self.recording:
            return func(*quiet_plain(args), **quiet_plain(kwargs))
        if func in _STATE_CHANGES:  # e.g. set_grad_enabled(self.training): a branch
            return func(*[plain_value(a) for a in args], **kwargs)
        kind, target = _classify(func)
        if kind == "method" and target in _DATA_ACCESS:
            self.graph_break(_DATA_ACCESS[target])
            return func(*quiet_plain(args), **quiet_plain(kwargs))
        if (
            self._dynamic_shape
            and (target in _SHAPE_QUERIES or target is torch.numel)
            and any(id(t) in self._dynamic_shape for t in _tensors_in(args))
        ):
            self.graph_break(
                f"data-dependent shape: {_qualname(func)} of a tensor whose shape "
                "depends on tensor values (nonzero, boolean mask, unique...)"
            )
            return func(*quiet_plain(args), **quiet_plain(kwargs))
        if self._branch is not None:
            result = self._call_in_branch(func, args, kwargs)
        else:
            result = func(*quiet_plain(args), **quiet_plain(kwargs))
        try:
            self._record_call(func, kind, target, args, kwargs, result)
        except _RecordingAborted:
            pass
        return result

    def _record_call(
        self,
        func: Any,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: Any,
    ) -> None:
        if result is NotImplemented:
            return
        if next(_tensors_in(result), None) is None:
            if kind == "getattr":
                self.read_metadata = True
                return  # a property (shape, dtype, grad=None...): a constant
            if kind == "setattr" or result is None or isinstance(result, RemovableHandle):
                pass  # a side effect (x[i] = v, x.register_hook(f)): record it as a node
            elif (
                isinstance(result, _METADATA_RESULT_TYPES)
                or (kind == "method" and target in _METADATA_NAMES)
                or (kind == "function" and getattr(func, "__name__", None) in _METADATA_NAMES)
                or func is torch.numel
                or func is torch.is_floating_point
                or func is torch.is_complex
            ):
                self.read_metadata = True
                return  # metadata: a constant, guarded by the caller's shape checks
            elif isinstance(result, (bool, int, float, complex, str, list, tuple)) or (
                type(result).__module__ == "numpy"
            ):
                self.graph_break(
                    f"data-dependent value: {_qualname(func)}() returned a Python "
                    f"{type(result).__name__}"
                )
                return
            else:
                self.graph_break(
                    f"cannot record {_qualname(func)}(): it returns a {type(result).__name__}"
                )
                return
        node_args, node_kwargs = self._graph_arg(args), self._graph_arg(kwargs)
        if kind == "method":
            node = self._create_node("call_method", target, node_args, node_kwargs)
        elif kind == "operator":
            function, reflected = _OPERATORS[target]
            if reflected:
                node_args = (node_args[1], node_args[0], *node_args[2:])
            node = self._create_node("call_function", function, node_args, node_kwargs)
        elif kind == "getattr":
            node = self._create_node("call_function", getattr, (node_args[0], target), {})
        elif kind == "setattr":
            node = self._create_node(
                "call_function", setattr, (node_args[0], target, node_args[1]), {}
            )
        else:
            node = self._create_node("call_function", func, node_args, node_kwargs)
        dynamic = False
        if kind in ("method", "function", "operator"):
            name = target if kind != "function" else getattr(func, "__name__", "")
            if name == "repeat_interleave":  # data-dependent only with tensor repeats
                dynamic = any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values()))
            elif name in _DATA_DEPENDENT_SHAPE_OPS:
                dynamic = True
            elif name == "where":  # the one-argument form is nonzero
                dynamic = len(args) + len(kwargs) == 1
            elif name == "__getitem__":  # boolean-mask indexing
                dynamic = any(t.dtype in (torch.bool, torch.uint8) for t in _tensors_in(args[1:]))
        if self._dynamic_shape and not dynamic:
            dynamic = any(id(t) in self._dynamic_shape for t in _tensors_in((args, kwargs)))
        self._bind_result(result, node, dynamic)

    # -- building nodes ------------------------------------------------------------

    def _create_node(self, op: str, target: Any, args: Any, kwargs: Any) -> fx.Node:
        self._sync_global_state()
        node = self.graph.create_node(op, target, tuple(args), dict(kwargs))
        _record_source(node)
        return node

    def _placeholder(self, name: str) -> fx.Node:
        where: ContextManager[Any]
        if self._last_placeholder is not None:
            where = self._root_graph.inserting_after(self._last_placeholder)
        else:
            first = next(iter(self._root_graph.nodes), None)
            where = (
                self._root_graph.inserting_before(first)
                if first is not None
                else contextlib.nullcontext()
            )
        with where:
            node = self._root_graph.placeholder(_identifier(name))
        self._last_placeholder = node
        return node

    def _flag_node(self, module: nn.Module) -> fx.Node:
        """The training placeholder of `module` (created on first use as a value)."""
        node = self._flag_nodes.get(id(module))
        if node is None:
            path = self._module_paths.get(id(module))
            if path is None:
                name = f"{type(module).__name__}_training"
            else:
                name = f"{path.replace('.', '_')}_training" if path else "training"
            node = self._placeholder(name)
            node.meta["nnscaler_input"] = None
            self._flag_nodes[id(module)] = node
            self._training_inputs.append(module)
            self._example_inputs.append(self._flag_value(module))
        return node

    def _flag_value(self, module: nn.Module) -> bool:
        entry = self._swapped.get(id(module))
        if entry is not None:
            return entry[2].value
        training = module.__dict__.get("training")
        return training.value if isinstance(training, TrainingFlag) else bool(training)

    def _ifexpr_node(self, module: nn.Module, true_value: Any, false_value: Any) -> fx.Node:
        flag = self._local(self._flag_node(module), self._flag_value(module))
        return self._create_node(
            "call_function",
            ifexpr,
            (flag, self._graph_arg(true_value), self._graph_arg(false_value)),
            {},
        )

    def _map(self, tensor: torch.Tensor, node: fx.Node, dynamic: bool = False) -> None:
        self._tensor_nodes[id(tensor)] = node
        self._keepalive.append(tensor)
        if dynamic:
            self._dynamic_shape.add(id(tensor))
        else:
            self._dynamic_shape.discard(id(tensor))

    def _bind_result(self, result: Any, node: fx.Node, dynamic: bool) -> None:
        """Map the tensors of an op's result to `node` (getitem nodes for containers).

        A result that *is* an input tensor (in-place ops, `out=`) now maps to the new
        node: the graph orders the mutation before every later use.
        """
        if isinstance(result, torch.Tensor):
            self._map(result, node, dynamic)
        elif isinstance(result, (tuple, list)):
            for index, item in enumerate(result):
                if next(_tensors_in(item), None) is not None:
                    self._bind_result(item, self._unpack(node, index), dynamic)
        elif isinstance(result, dict):
            for key, item in result.items():
                if next(_tensors_in(item), None) is not None:
                    self._bind_result(item, self._unpack(node, key), dynamic)

    def _unpack(self, node: fx.Node, key: Any) -> fx.Node:
        item = self.graph.call_function(operator.getitem, (node, key))
        item.meta["nnscaler_unpack"] = True
        for key in ("nnscaler_source", "source_loc", "stack_trace"):
            if key in node.meta:
                item.meta[key] = node.meta[key]
        return item

    def _node_for_tensor(self, tensor: torch.Tensor) -> fx.Node:
        node = self._tensor_nodes.get(id(tensor))
        if node is not None:
            return node
        path = self._param_paths.get(id(tensor))
        if path is not None:
            node = self._get_attr(path, tensor)
        elif isinstance(tensor, FakeTensor):
            # Made inside a cond branch but not by a recorded op (or leaked out of one).
            self.graph_break(
                "a tensor of a torch.cond branch was made outside torch function dispatch"
            )
            raise _RecordingAborted
        else:
            with torch._C.DisableTorchFunction():
                computed = tensor.grad_fn is not None
            if computed:
                # It was computed in this run, but not through torch function dispatch
                # (e.g. under torch._C.DisableTorchFunction): baking it in would be wrong.
                self.graph_break(
                    "a tensor computed outside torch function dispatch "
                    f"({type(tensor.grad_fn).__name__}) reached the graph"
                )
                raise _RecordingAborted
            node = self._constant(tensor, "tensor_constant")
        self._map(tensor, node)
        return node

    def _get_attr(self, target: str, value: Any) -> fx.Node:
        node = self._attr_nodes.get(target)
        if node is None:
            self._attr_values[target] = value
            node = self._root_graph.get_attr(target)
            self._attr_nodes[target] = node
        return node

    def _constant(self, value: Any, hint: str) -> fx.Node:
        return self._get_attr(self._constant_name(value, hint), value)

    def _constant_name(self, value: Any, hint: str) -> str:
        name = self._constant_ids.get(id(value))
        if name is None:
            name = f"_{hint}{next(self._constant_counter)}"
            self._constant_ids[id(value)] = name
            self._attr_values[name] = value
            self._keepalive.append(value)
        return name

    def _module_target(self, module: nn.Module) -> str:
        """The GraphModule attribute naming `module`, and where the runner finds it.

        A module of the root's tree is named by its path (the root itself, which has
        the empty path, as `_self`), and the runner reaches it from the root slot; a
        module outside any tree (root=None only) is a constant.
        """
        path = self._module_paths.get(id(module))
        if path is None:
            return self._constant_name(module, "module")
        target = path or "_self"
        self._attr_values.setdefault(target, module)
        self._module_targets[target] = path
        return target

    def _graph_arg(self, value: Any) -> Any:
        """`value` as an fx argument: tensors, flags and tracked numbers become nodes."""
        if isinstance(value, torch.Tensor):
            return self._local(self._node_for_tensor(value), value)
        if isinstance(value, TrainingFlag):
            if value.tracer is not self:
                return value.value
            return self._local(self._flag_node(value.module), value.value)
        if isinstance(value, _TrackedNumber):
            return self._local(value.node, value.plain) if value.tracer is self else value.plain
        if isinstance(value, (tuple, list)):
            items = [self._graph_arg(v) for v in value]
            if isinstance(value, list):
                return items
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, dict):
            return {k: self._graph_arg(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(
                self._graph_arg(value.start),
                self._graph_arg(value.stop),
                self._graph_arg(value.step),
            )
        if isinstance(value, _LITERAL_TYPES):
            return value
        if isinstance(value, nn.Module):
            if id(value) not in self._module_paths and self.root is not None:
                self.graph_break(
                    f"a module outside self's module tree ({type(value).__name__}) "
                    "was passed to an op"
                )
                raise _RecordingAborted
            target = self._module_target(value)
            node = self._attr_nodes.get(target)
            if node is None:
                node = self._attr_nodes[target] = self._root_graph.get_attr(target)
            return self._local(node, value)
        return self._constant(value, f"const_{type(value).__name__}_")

    def _call_opaque_module(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        call = trace_patches.original_module_call
        path = self._module_paths.get(id(module))
        if path is None and self.root is not None:
            self.graph_break(
                f"a submodule with hooks ({type(module).__name__}) that is not "
                "reachable from self's module tree"
            )
            return call(module, *args, **kwargs)
        try:
            node_args, node_kwargs = self._graph_arg(args), self._graph_arg(kwargs)
        except _RecordingAborted:
            return call(module, *args, **kwargs)
        self._opaque[id(module)] = module
        with self.suspended(tuple(module.modules())):
            result = call(module, *quiet_plain(args), **quiet_plain(kwargs))
        if not self.recording:
            return result
        outside = [
            v
            for v in pytree.tree_leaves(result)
            if not isinstance(v, (torch.Tensor, *_LITERAL_TYPES))
        ]
        if outside:
            self.graph_break(
                f"a module with hooks ({type(module).__name__}) returned a "
                f"{type(outside[0]).__name__}, which the graph cannot carry"
            )
            return result
        target = self._module_target(module)
        try:
            node = self._create_node("call_module", target, node_args, node_kwargs)
        except _RecordingAborted:
            return result
        self._bind_result(result, node, dynamic=False)
        return result

    # -- global torch state ----------------------------------------------------------

    @staticmethod
    def _autocast_state(device: str) -> tuple[bool, torch.dtype, bool]:
        return (
            torch.is_autocast_enabled(device),
            torch.get_autocast_dtype(device),
            torch.is_autocast_cache_enabled(),
        )

    def _sync_global_state(self) -> None:
        """Make the graph's grad mode and autocast state match the run's, before a node.

        Comparing state (instead of recording `no_grad().__enter__`) also sees changes
        made without a torch call, and `with` blocks come out as set / restore pairs.
        """
        if torch.is_inference_mode_enabled() != self._entry_inference_mode:
            self.graph_break("torch.inference_mode() changed inside forward")
            raise _RecordingAborted
        mode = torch.is_grad_enabled()
        if mode != self._graph_grad_mode:
            node = self.graph.call_function(trace_patches.REAL_SET_GRAD_ENABLED, (mode,))
            _record_source(node)
            self._graph_grad_mode = mode
        for device in _AUTOCAST_DEVICES:
            state = self._autocast_state(device)
            if state == self._graph_autocast[device]:
                continue
            opened = self._open_autocast.pop(device, None)
            if opened is not None:
                _record_source(
                    self.graph.call_function(torch.amp.autocast_mode._exit_autocast, (opened,))
                )
            if state != self._entry_autocast[device]:
                enabled, dtype, cache = state
                self._open_autocast[device] = self.graph.call_function(
                    torch.amp.autocast_mode._enter_autocast, (device, dtype, enabled, cache)
                )
                _record_source(self._open_autocast[device])
            self._graph_autocast[device] = state

    # -- the end -----------------------------------------------------------------------

    def _record_output(self, result: Any) -> Optional[OutputLayout]:
        leaves, spec = pytree.tree_flatten(result)
        layout: list[Any] = []
        graph_outputs: list[Any] = []
        try:
            for leaf in leaves:
                if isinstance(leaf, (torch.Tensor, TrainingFlag, _TrackedNumber)):
                    value = self._graph_arg(leaf)
                    if isinstance(value, fx.Node):
                        layout.append(GraphOutput(len(graph_outputs)))
                        graph_outputs.append(value)
                    else:
                        layout.append(ConstantOutput(value))
                elif isinstance(leaf, _LITERAL_TYPES):
                    layout.append(ConstantOutput(leaf))
                else:
                    slot = next((i for i, s in enumerate(self.slots) if s is leaf), None)
                    if slot is not None:
                        layout.append(SlotOutput(slot))
                    elif isinstance(leaf, nn.Module) or _holds_tensor(leaf):
                        self.graph_break(
                            f"forward returns a {type(leaf).__name__}, which the graph "
                            "cannot rebuild (register it with torch.utils._pytree)",
                            location=self._forward_location(),
                        )
                        return None
                    else:
                        layout.append(ConstantOutput(leaf))
            self._sync_global_state()  # e.g. grad mode left changed by the forward
        except _RecordingAborted:
            return None
        self.graph.output(tuple(graph_outputs))
        return OutputLayout(spec, tuple(layout))

    def _make_capture(self, result: Any, layout: Optional[OutputLayout]) -> Capture:
        graph_module: Optional[fx.GraphModule] = None
        runner_spec: Optional[RunnerSpec] = None
        name = str(
            getattr(self.fn, "__qualname__", None)
            or getattr(self.fn, "__name__", None)
            or "forward"
        )
        if self.fallback is None and layout is not None:
            self.graph.lint()
            # Lazy: fx compiles the module's Python source only when .code or forward
            # is used (explain, export, backends). An eager GraphModule costs a
            # compile() per capture and leaves a cache key behind in torch.fx.
            with _lazy_graph_module._use_lazy_graph_module(True):
                graph_module = _lazy_graph_module._make_graph_module(
                    self._attribute_source(), self.graph, class_name=_class_name(name)
                )
            runner_spec = RunnerSpec(
                name=name,
                graph=self.graph,
                attr_values=dict(self._attr_values),
                slot_names=self.slot_names,
                root_slot=0 if self.root is not None else None,
                module_paths=dict(self._module_targets),
                flag_names=tuple(
                    n.name
                    for n in self.graph.nodes
                    if n.op == "placeholder" and n.meta.get("nnscaler_input") is None
                ),
                output=layout,
                entry_grad_mode=self._entry_grad_mode,
            )
        capture = Capture(
            result=_plain_result(result),
            graph_module=graph_module,
            fallback=self.fallback,
            training_inputs=list(self._training_inputs) if graph_module is not None else [],
            branched_training=list(self._branched.values()),
            visited_modules=list(self._visited.values()),
            opaque_modules=list(self._opaque.values()),
            slot_names=self.slot_names,
            runner_spec=runner_spec,
            _example_inputs=self._example_inputs if graph_module is not None else [],
            read_metadata=self.read_metadata,
        )
        # The trace's bookkeeping holds every intermediate tensor: drop it now.
        self._tensor_nodes.clear()
        self._keepalive.clear()
        return capture

    def _attribute_source(self) -> nn.Module:
        """A module to build the GraphModule from, that never writes to user modules.

        fx copies each get_attr / call_module target from it; top-level names point at
        the root's real children, so parameters stay the live objects.
        """
        source = nn.Module()
        for target, value in self._attr_values.items():
            head = target.split(".", 1)[0]
            if "." not in target:
                source.__dict__[head] = value
            elif head not in source.__dict__ and self.root is not None:
                source.__dict__[head] = getattr(self.root, head)
        if "_self" in self._module_targets:
            source.__dict__["_self"] = self.root
        return source


# ---------------------------------------------------------------------------
# Small helpers


def _key_suffix(key: Any) -> str:
    if isinstance(key, pytree.SequenceKey):
        return f"_{key.idx}"
    if isinstance(key, pytree.MappingKey):
        return f"_{key.key}"
    if isinstance(key, pytree.GetAttrKey):
        return f"_{key.name}"
    return "_"


def _identifier(name: str) -> str:
    """`name` as a Python identifier (fx writes placeholders as parameters)."""
    name = re.sub(r"\W+", "_", name).strip("_") or "input"
    return f"_{name}" if name[0].isdigit() else name


def _class_name(qualname: str) -> str:
    return (
        "".join(
            part[:1].upper() + part[1:]
            for part in qualname.replace("<", "").replace(">", "").replace(".", "_").split("_")
            if part
        )
        + "Graph"
    )


def _plain_result(result: Any) -> Any:
    """The result as eager returns it: no flag or tracked number may leave the trace."""
    leaves, spec = pytree.tree_flatten(result)
    if not any(isinstance(leaf, (TrainingFlag, _TrackedNumber)) for leaf in leaves):
        return result
    return pytree.tree_unflatten([quiet_plain(leaf) for leaf in leaves], spec)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, torch.Tensor)


def _same_tensor_kind(a: Any, b: Any) -> bool:
    """Both tensors, with the same metadata: then one graph serves both branches."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    with torch._C.DisableTorchFunction():
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and a.requires_grad == b.requires_grad
        )


def _deps_of(value: Any) -> tuple[nn.Module, ...]:
    if isinstance(value, TrainingFlag):
        return (value.module,)
    if isinstance(value, _TrackedNumber):
        return tuple(value.deps)
    return ()


def _deps_of_args(value: Any) -> tuple[nn.Module, ...]:
    """Modules whose training flag an opaque op could read through its arguments."""
    if isinstance(value, nn.Module):
        return (value,)
    if isinstance(value, (TrainingFlag, _TrackedNumber)):
        return _deps_of(value)
    if isinstance(value, (tuple, list)):
        return tuple(m for v in value for m in _deps_of_args(v))
    if isinstance(value, dict):
        return tuple(m for v in value.values() for m in _deps_of_args(v))
    return ()


def _unique_modules(modules: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
    seen: dict[int, nn.Module] = {}
    for module in modules:
        seen.setdefault(id(module), module)
    return tuple(seen.values())


def _tracked(value: Any, node: fx.Node, deps: tuple[nn.Module, ...], tracer: Tracer) -> Any:
    if isinstance(value, float):
        return TrackedFloat(value, node, deps, tracer)
    return TrackedInt(value, node, deps, tracer)
