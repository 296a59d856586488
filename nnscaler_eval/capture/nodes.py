"""Tensor-to-node mapping: which node of the graph stands for each value of the run.

Tensors are tracked by identity (`id` -> the node that produced it; every tensor seen
is kept alive until the trace ends, so ids are not reused). Tensor leaves of the
argument slots are placeholders; parameters and buffers of the root's tree are
`get_attr` nodes by qualified name (so in-place optimizer updates are seen without
recapture); any other tensor met is a constant attribute. Placeholders, `get_attr`
nodes and constants live in the root graph, whatever graph (a torch.cond branch's) is
being recorded into.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import re
from typing import Any, ContextManager, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from nnscaler_eval.runners.block_reuse import META_CHANGED, VALUE_META, value_meta

from nnscaler_eval.capture.calls import tensors_in


class NodeMap:
    """The identity maps of one trace, and the root graph's inputs and attributes."""

    def __init__(self, root_graph: fx.Graph, root: Optional[nn.Module]) -> None:
        self.root_graph = root_graph
        # Tensor identity -> node; every tensor seen is kept alive so ids stay unique.
        self.tensor_nodes: dict[int, fx.Node] = {}
        self.keepalive: list[Any] = []
        # Tensors whose shape came from data -> why (capture/data_dependence.py).
        self.dynamic_shape: dict[int, str] = {}
        # get_attr / call_module targets -> objects, for the GraphModule and the runner.
        self.attr_values: dict[str, Any] = {}
        self.attr_nodes: dict[str, fx.Node] = {}
        self._constant_ids: dict[int, str] = {}
        self._constant_counter = itertools.count()
        self.module_targets: dict[str, str] = {}  # GraphModule target -> path from root

        # The root's tree, by identity.
        self.module_paths: dict[int, str] = {}
        self.param_paths: dict[int, str] = {}
        if root is not None:
            for name, module in root.named_modules(remove_duplicate=False):
                self.module_paths.setdefault(id(module), name)
            for name, parameter in root.named_parameters(remove_duplicate=False):
                self.param_paths.setdefault(id(parameter), name)
            for name, buffer in root.named_buffers(remove_duplicate=False):
                self.param_paths.setdefault(id(buffer), name)

        # Placeholders in creation order, and their values in the traced run.
        self._last_placeholder: Optional[fx.Node] = None
        self.example_inputs: list[Any] = []

    def forget(self) -> None:
        """Drop the bookkeeping that holds every intermediate tensor of the run."""
        self.tensor_nodes.clear()
        self.keepalive.clear()

    # -- tensors -------------------------------------------------------------------

    def map(self, tensor: torch.Tensor, node: fx.Node, dynamic: Optional[str] = None) -> None:
        """`tensor` is `node`'s value; `dynamic`: why its shape depends on data.  The
        value's metadata as it is now goes into `node.meta[VALUE_META]`."""
        self.tensor_nodes[id(tensor)] = node
        described = value_meta(tensor)
        if described is not None:
            node.meta[VALUE_META] = described
        self.keepalive.append(tensor)
        if dynamic:
            self.dynamic_shape[id(tensor)] = dynamic
        else:
            self.dynamic_shape.pop(id(tensor), None)

    def dynamic_among(self, value: Any) -> Optional[str]:
        """Why a tensor `value` holds has a shape that depends on tensor values, or
        None when none has."""
        if not self.dynamic_shape:
            return None
        for tensor in tensors_in(value):
            reason = self.dynamic_shape.get(id(tensor))
            if reason is not None:
                return reason
        return None

    def known(self, tensor: torch.Tensor) -> Optional[fx.Node]:
        """The node of a tensor seen before, or the `get_attr` of a parameter or buffer
        of the root's tree; None for any other tensor."""
        node = self.tensor_nodes.get(id(tensor))
        if node is not None:
            recorded = node.meta.get(VALUE_META)
            if recorded is not None and value_meta(tensor) != recorded:
                # changed in place since (or an alias was): VALUE_META is not
                # what this use sees (runners/block_reuse.py)
                node.meta[META_CHANGED] = True
            return node
        path = self.param_paths.get(id(tensor))
        if path is None:
            return None
        node = self.get_attr(path, tensor)
        self.map(tensor, node)
        return node

    def constant_tensor(self, tensor: torch.Tensor) -> fx.Node:
        """A tensor met for the first time, not computed in this run: a constant."""
        node = self.constant(tensor, "tensor_constant")
        self.map(tensor, node)
        return node

    def bind_result(self, result: Any, node: fx.Node, dynamic: Optional[str]) -> None:
        """Map the tensors of an op's result to `node` (getitem nodes for containers);
        `dynamic`: why their shapes depend on data (None: they do not).

        A result that *is* an input tensor (in-place ops, `out=`) now maps to the new
        node: the graph orders the mutation before every later use.
        """
        if isinstance(result, torch.Tensor):
            self.map(result, node, dynamic)
        elif isinstance(result, (tuple, list)):
            for index, item in enumerate(result):
                if next(tensors_in(item), None) is not None:
                    self.bind_result(item, _unpack(node, index), dynamic)
        elif isinstance(result, dict):
            for key, item in result.items():
                if next(tensors_in(item), None) is not None:
                    self.bind_result(item, _unpack(node, key), dynamic)

    # -- the root graph's inputs and attributes ---------------------------------------

    def placeholder(self, name: str, example: Any) -> fx.Node:
        """A new input of the root graph, after the others; `example` is its value in
        this run (for backends)."""
        where: ContextManager[Any]
        if self._last_placeholder is not None:
            where = self.root_graph.inserting_after(self._last_placeholder)
        else:
            first = next(iter(self.root_graph.nodes), None)
            where = (
                self.root_graph.inserting_before(first)
                if first is not None
                else contextlib.nullcontext()
            )
        with where:
            node = self.root_graph.placeholder(identifier(name))
        self._last_placeholder = node
        self.example_inputs.append(example)
        return node

    def get_attr(self, target: str, value: Any) -> fx.Node:
        node = self.attr_nodes.get(target)
        if node is None:
            self.attr_values[target] = value
            node = self.root_graph.get_attr(target)
            self.attr_nodes[target] = node
        return node

    def constant(self, value: Any, hint: str) -> fx.Node:
        return self.get_attr(self.constant_name(value, hint), value)

    def constant_name(self, value: Any, hint: str) -> str:
        name = self._constant_ids.get(id(value))
        if name is None:
            name = f"_{hint}{next(self._constant_counter)}"
            self._constant_ids[id(value)] = name
            self.attr_values[name] = value
            self.keepalive.append(value)
        return name

    def module_target(self, module: nn.Module) -> str:
        """The GraphModule attribute naming `module`, and where the runner finds it.

        A module of the root's tree is named by its path (the root itself, which has
        the empty path, as `_self`), and the runner reaches it from the root slot; a
        module outside any tree (root=None only) is a constant.
        """
        path = self.module_paths.get(id(module))
        if path is None:
            return self.constant_name(module, "module")
        target = path or "_self"
        self.attr_values.setdefault(target, module)
        self.module_targets[target] = path
        return target

    def module_node(self, module: nn.Module) -> fx.Node:
        """The `get_attr` node of a module passed to an op."""
        target = self.module_target(module)
        node = self.attr_nodes.get(target)
        if node is None:
            node = self.attr_nodes[target] = self.root_graph.get_attr(target)
        return node


def _unpack(node: fx.Node, key: Any) -> fx.Node:
    """`node[key]`, in the graph `node` is in (the one being recorded into)."""
    item = node.graph.call_function(operator.getitem, (node, key))
    item.meta["nnscaler_unpack"] = True
    for key in ("nnscaler_source", "source_loc", "stack_trace", "nnscaler_calls"):
        if key in node.meta:
            item.meta[key] = node.meta[key]
    return item


def identifier(name: str) -> str:
    """`name` as a Python identifier (fx writes placeholders as parameters)."""
    name = re.sub(r"\W+", "_", name).strip("_") or "input"
    return f"_{name}" if name[0].isdigit() else name


def class_name(qualname: str) -> str:
    """A GraphModule class name from a function's qualified name."""
    return (
        "".join(
            part[:1].upper() + part[1:]
            for part in qualname.replace("<", "").replace(">", "").replace(".", "_").split("_")
            if part
        )
        + "Graph"
    )
