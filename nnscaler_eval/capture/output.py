"""Output assembly: the forward's result as graph outputs, and the finished `Capture`.

The graph returns a flat tuple (the tensor and tracked-number leaves of the result);
the `OutputLayout` says how the runner rebuilds the real structure around it: graph
outputs, constants, and argument slots returned as they are.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch.fx import _lazy_graph_module
import torch.nn as nn
import torch.utils._pytree as pytree

from nnscaler_eval.capture.calls import LITERAL_TYPES
from nnscaler_eval.capture.inputs import holds_tensor
from nnscaler_eval.capture.nodes import NodeMap, class_name
from nnscaler_eval.capture.results import Capture, Fallback
from nnscaler_eval.guarding.keyed_objects import kv_cache_class
from nnscaler_eval.capture.training import TrackedModules
from nnscaler_eval.capture.passed_objects import ObjectSnapshot
from nnscaler_eval.capture.python_values import TRACKED_SEQUENCES
from nnscaler_eval.runners.codegen import (
    ConstantOutput, GraphOutput, InputPath, OutputLayout, RebuiltOutput, RunnerSpec, SlotOutput,
)
from nnscaler_eval.tracing.tracked_values import TrainingFlag, _TrackedNumber, quiet_plain


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _holds_symbolic(value: Any, depth: int = 2) -> bool:
    """A symbolic size or scalar inside an object the runner would return as a
    constant (its attributes, or a container's items, `depth` levels down): it would
    leak this capture's symbol instead of the call's value."""
    if isinstance(value, _SYMBOLIC):
        return True
    if depth == 0 or isinstance(value, (str, bytes, torch.Tensor, type)):
        return False
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        items = getattr(value, "__dict__", {}).values()
    return any(_holds_symbolic(item, depth - 1) for item in list(items)[:64])


# Values an object's template keeps as they are: immutable, so sharing them between
# the objects of several calls is what building each object anew would give.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype,
              torch.device, torch.layout, torch.memory_format, type)
_TEMPLATE_DEPTH = 6


def rebuildable(value: Any) -> bool:
    """A transformers KV cache, or one of its layers: an object the runner can build
    anew per call (`object.__new__` and its `__dict__`; no `__slots__`, no `__new__` of
    its own).  Only those: an arbitrary object may hold state its `__dict__` does not
    show (C fields, identity other code relies on)."""
    return isinstance(getattr(value, "__dict__", None), dict) and kv_cache_class(type(value))


def object_shape(value: Any, graph_arg: Callable[[Any], Any], graph_outputs: list[Any],
                 seen: set[int], depth: int = _TEMPLATE_DEPTH,
                 passed: Callable[[Any], Any] = lambda value: None) -> Optional[tuple]:
    """The RebuiltOutput shape of `value` (codegen.RebuiltOutput), its tensors appended
    to `graph_outputs` as nodes; None when part of it cannot be built anew per call
    (an object of another kind, one object reached twice, too deep).  An object passed
    in (a KV cache argument) is itself: `passed(value)` gives its InputPath."""
    where = passed(value) if not isinstance(value, (torch.Tensor, *_IMMUTABLE)) else None
    if where is not None:
        return ("input", where)
    if isinstance(value, (torch.Tensor, *_SYMBOLIC)):
        node = graph_arg(value)
        if not isinstance(node, fx.Node):
            return ("constant", node)
        graph_outputs.append(node)
        return ("graph", len(graph_outputs) - 1)
    if isinstance(value, _IMMUTABLE):
        return ("constant", value)
    if depth == 0 or id(value) in seen:
        return None
    seen.add(id(value))
    if type(value) in (list, tuple):
        items = [object_shape(v, graph_arg, graph_outputs, seen, depth - 1, passed)
                 for v in value]
        return None if None in items else ("list" if type(value) is list else "tuple",
                                           tuple(items))
    if type(value) is dict:
        if not all(isinstance(k, (bool, int, str)) for k in value):
            return None
        entries = [(k, object_shape(v, graph_arg, graph_outputs, seen, depth - 1, passed))
                   for k, v in value.items()]
        return None if any(s is None for _, s in entries) else ("dict", tuple(entries))
    if rebuildable(value):
        fields = [(name, object_shape(v, graph_arg, graph_outputs, seen, depth - 1, passed))
                  for name, v in vars(value).items()]
        if any(s is None for _, s in fields):
            return None
        return ("object", type(value), tuple(fields))
    return None


def output_layout(
    result: Any,
    slots: tuple[Any, ...],
    graph_arg: Callable[[Any], Any],
    refuse: Callable[[str], None],
    rebuild_objects: bool = False,
    passed: Optional[ObjectSnapshot] = None,
) -> Optional[tuple[OutputLayout, list[fx.Node]]]:
    """How the runner rebuilds `result`, and the nodes the graph returns.

    `graph_arg` turns a tensor, flag or tracked number into its node (it may raise
    RecordingAborted); a leaf the runner could not rebuild is handed to `refuse`, which
    ends the capture, and then there is no layout (None).  With `rebuild_objects`, a
    KV cache the forward returns is built anew by the runner (`rebuildable`).
    `passed`: the KV caches passed in, before the forward ran: one returned is itself,
    and what the forward wrote into them becomes the layout's writes.
    """
    def where(value: Any) -> Optional[InputPath]:
        at = passed.where(value) if passed else None
        return InputPath(*at) if at is not None else None

    leaves, spec = pytree.tree_flatten(result)
    layout: list[Any] = []
    graph_outputs: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, (torch.Tensor, TrainingFlag, _TrackedNumber, *TRACKED_SEQUENCES,
                             *_SYMBOLIC)):
            # a symbolic size or scalar (a dynamic capture), a shape or number from the
            # inputs (python_values), is computed by the graph
            value = graph_arg(leaf)
            if isinstance(value, fx.Node):
                layout.append(GraphOutput(len(graph_outputs)))
                graph_outputs.append(value)
            else:
                layout.append(ConstantOutput(value))
        elif isinstance(leaf, LITERAL_TYPES):
            layout.append(ConstantOutput(leaf))
        else:
            slot = next((i for i, s in enumerate(slots) if s is leaf), None)
            shape = (object_shape(leaf, graph_arg, graph_outputs, set(), passed=where)
                     if slot is None and rebuild_objects and (
                         rebuildable(leaf) or where(leaf) is not None) else None)
            if slot is not None:
                layout.append(SlotOutput(slot))
            elif shape is not None:
                layout.append(RebuiltOutput(shape))
            elif isinstance(leaf, nn.Module) or holds_tensor(leaf) or _holds_symbolic(leaf):
                refuse(
                    f"forward returns a {type(leaf).__name__}, which the graph "
                    "cannot rebuild (register it with torch.utils._pytree)"
                )
                return None
            else:
                layout.append(ConstantOutput(leaf))
    writes: list[tuple] = []
    if passed:
        found, reason = passed.writes(
            lambda value: object_shape(value, graph_arg, graph_outputs, set(), passed=where))
        if reason is not None:
            refuse(reason)
            return None
        writes = [(kind, InputPath(*at), *rest) for kind, at, *rest in found]
    return OutputLayout(spec, tuple(layout), tuple(writes)), graph_outputs


def make_capture(
    *,
    fn: Any,
    result: Any,
    layout: Optional[OutputLayout],
    graph: fx.Graph,
    nodes: NodeMap,
    modules: TrackedModules,
    root: Optional[nn.Module],
    slot_names: tuple[str, ...],
    fallback: Optional[Fallback],
    entry_grad_mode: bool,
    read_metadata: bool,
    metadata_tensors: list[torch.Tensor],
    unproven_constants: list[torch.Tensor] = (),   # type: ignore[assignment]
    branch_notes: list[Any] = (),   # type: ignore[assignment]
) -> Capture:
    """The Capture of a finished trace: with a GraphModule and a runner spec unless it
    fell back (or its output could not be laid out)."""
    graph_module: Optional[fx.GraphModule] = None
    runner_spec: Optional[RunnerSpec] = None
    name = str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or "forward")
    if fallback is None and layout is not None:
        graph.lint()
        # Lazy: fx compiles the module's Python source only when .code or forward
        # is used (explain, export, backends). An eager GraphModule costs a
        # compile() per capture and leaves a cache key behind in torch.fx.
        with _lazy_graph_module._use_lazy_graph_module(True):
            graph_module = _lazy_graph_module._make_graph_module(
                attribute_source(nodes, root), graph, class_name=class_name(name)
            )
        runner_spec = RunnerSpec(
            name=name,
            graph=graph,
            attr_values=dict(nodes.attr_values),
            slot_names=slot_names,
            root_slot=0 if root is not None else None,
            module_paths=dict(nodes.module_targets),
            flag_names=tuple(
                n.name
                for n in graph.nodes
                if n.op == "placeholder" and n.meta.get("nnscaler_input") is None
            ),
            output=layout,
            entry_grad_mode=entry_grad_mode,
            state_writes=tuple(
                (nodes.module_paths[id(module)], name, value)
                for module, name, _, value in modules.writes.values()
            ),
        )
    return Capture(
        result=plain_result(result),
        graph_module=graph_module,
        fallback=fallback,
        training_inputs=list(modules.training_inputs) if graph_module is not None else [],
        branched_training=list(modules.branched.values()),
        visited_modules=list(modules.visited.values()),
        opaque_modules=list(modules.opaque.values()),
        slot_names=slot_names,
        runner_spec=runner_spec,
        _example_inputs=nodes.example_inputs if graph_module is not None else [],
        read_metadata=read_metadata,
        metadata_tensors=metadata_tensors if graph_module is not None else [],
        unproven_constants=list(unproven_constants) if graph_module is not None else [],
        state_writes=[tuple(w) for w in modules.writes.values()]   # type: ignore[misc]
        if graph_module is not None else [],
        branch_notes=list(branch_notes),
    )


def attribute_source(nodes: NodeMap, root: Optional[nn.Module]) -> nn.Module:
    """A module to build the GraphModule from, that never writes to user modules.

    fx copies each get_attr / call_module target from it; top-level names point at
    the root's real children, so parameters stay the live objects.
    """
    source = nn.Module()
    for target, value in nodes.attr_values.items():
        head = target.split(".", 1)[0]
        if "." not in target:
            source.__dict__[head] = value
        elif head not in source.__dict__ and root is not None:
            source.__dict__[head] = getattr(root, head)
    if "_self" in nodes.module_targets:
        source.__dict__["_self"] = root
    return source


def plain_result(result: Any) -> Any:
    """The result as eager returns it: no flag or tracked number may leave the trace."""
    leaves, spec = pytree.tree_flatten(result)
    if not any(isinstance(leaf, (TrainingFlag, _TrackedNumber)) for leaf in leaves):
        return result
    return pytree.tree_unflatten([quiet_plain(leaf) for leaf in leaves], spec)
