"""Block reuse: a repeated submodule call compiled once (`CompileConfig.block_reuse`).

A capture records every submodule call it traces inline (`Capture.inline_calls`) and
marks each node with the calls it was made in (`meta["nnscaler_calls"]`, outermost
first).  Before a graph goes to a backend that compiles (`REUSING_BACKENDS`), the
calls whose recorded nodes are the same computation become one subgraph: the graph
calls it through `torch.ops.higher_order.invoke_subgraph(subgraph, identifier,
*operands)`, the form `torch.compiler.nested_compile_region` gives Dynamo's graphs,
with the block's parameters and buffers as operands.  AOTAutograd traces, and Inductor
compiles, each identifier once, forward and backward, however often it is called.

What decides sharing is the traced nodes themselves, never the source: two calls share
a subgraph only when they were calls of the same class running the same `forward`
code, and their nodes are equal one by one (targets, constant arguments compared with
their types, the same wiring) over inputs of equal metadata (shape, strides, dtype,
device, `requires_grad`).  A block that differs in anything the graph depends on (a
shape, a dtype, a training flag, a module with a hook inside, a frozen BatchNorm)
traces to different nodes and keeps its own.  What `invoke_subgraph` cannot stand for
stays inline, as the plain graph has it:
- a call whose nodes are not one run of the graph (a grad-mode or autocast switch the
  capture put in between), or that calls anything but torch (an opaque module, a
  `register_op` op, a hook node, a higher-order op);
- a call whose subgraph writes into an input (BatchNorm's running statistics in
  training) or returns a view of an input or two views of one tensor: Dynamo forms
  no invoke_subgraph with such aliasing either, and such a block is compiled inline,
  where eager's buffer updates stay as the whole-graph compile has them.  Random
  numbers (dropout in training) are allowed, as `nested_compile_region` allows them:
  each call draws its own;
- calls with fewer than `MIN_OPS` operations (a lone Linear gains nothing).
Calls are chosen from the outside in: a repeated block is one subgraph, and the
repeated layers inside it are not looked at again.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from nnscaler_eval.runners import backend_form

# node.meta key: the metadata of the node's value in the traced run (value_meta), set by
# capture/nodes.py: what the keys compare, without running the graph again on fakes.
VALUE_META = "nnscaler_value_meta"
# node.meta key, set by capture/nodes.py: the value's metadata changed after it was
# recorded (an in-place op on the tensor or on an alias of it: `base.mul_(w)` makes
# a view of `base` require grad), so VALUE_META does not say what a later use saw.
META_CHANGED = "nnscaler_value_meta_changed"


def value_meta(tensor: torch.Tensor) -> Optional[tuple]:
    """(shape, stride, storage offset, dtype, device, requires_grad) of a plain tensor
    (exactly torch.Tensor or nn.Parameter: reading them runs no Python) with concrete
    sizes; None for a symbolic one or a subclass, whose attributes may be user code."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return None
    return backend_form.tensor_metadata(tensor)


# torch.compile backends that trace with AOTAutograd, which compiles each
# invoke_subgraph identifier once.  Other backends get the plain graph.
REUSING_BACKENDS = frozenset({"inductor", "aot_eager", "aot_eager_decomp_partition"})
MIN_OPS = 4
CALLS_META = "nnscaler_calls"
_identifiers = itertools.count()


# Inductor's settings for a graph that calls a shared block.  Its buffer reuse and
# in-place buffers (torch 2.13) treat a buffer of the calling graph as dead after
# its last use as an operand, though the subgraph's outputs may alias it: the
# partitioned forward of a training graph returns its inputs as activations saved
# for the backward.  The next buffer of that size then overwrites a saved input (a
# block's input made by a Linear between blocks), and the backward gets wrong
# gradients; regional torch.compile (`nested_compile_region`) gets the same numbers.
INDUCTOR_SETTINGS = {"allow_buffer_reuse": False, "inplace_buffers": False}


def compile_settings(gm: Any) -> contextlib.AbstractContextManager:
    """Inductor's INDUCTOR_SETTINGS while `gm` is compiled, when it calls a shared
    block; nothing otherwise."""
    graph = getattr(gm, "graph", None)
    if graph is None or not graph.find_nodes(
            op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        return contextlib.nullcontext()
    from torch._inductor import config as inductor_config

    return inductor_config.patch(INDUCTOR_SETTINGS)


@dataclass
class SharedBlock:
    """One subgraph the backend graph calls more than once."""

    identifier: str
    paths: list[str]            # the modules that call it, in call order
    cls: str                    # their class
    ops: int                    # operations in the subgraph

    def __str__(self) -> str:
        return (f"{self.identifier}: {len(self.paths)} calls of {self.cls} "
                f"({self.ops} ops) share one subgraph: {', '.join(self.paths)}")


@dataclass
class _Call:
    index: int
    depth: int
    parents: tuple[int, ...]
    members: list[fx.Node] = field(default_factory=list)
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    key: Any = None


def share_repeated_blocks(gm: fx.GraphModule, example_inputs: list[Any],
                          inline_calls: list[tuple[Optional[str], type, Any]]
                          ) -> tuple[fx.GraphModule, list[SharedBlock]]:
    """`gm` with each repeated block's calls made calls of one subgraph, and what is
    shared; `gm` itself when nothing is (or the graph cannot be run on fakes)."""
    if not inline_calls or any(not isinstance(v, torch.Tensor) or backend_form._is_fake(v)
                               for v in example_inputs):
        return gm, []   # symbolic captures keep their graph (their inputs are fakes)
    calls = _calls_of(gm, len(inline_calls))
    if sum(len(c.members) >= MIN_OPS for c in calls.values()) < 2:
        return gm, []
    mode = backend_form._static_mode(example_inputs)
    if mode is None:
        return gm, []
    metas = _recorded_metas(gm, example_inputs, calls.values())
    if metas is None:   # the capture did not describe every value a block call needs
        if not backend_form.annotate_example_values(gm, mode, example_inputs):
            return gm, []
        metas = {n: backend_form.tensor_metadata(n.meta["example_value"]) for n in gm.graph.nodes
                 if isinstance(n.meta.get("example_value"), torch.Tensor)}
    try:
        states = _global_states(gm, calls.values())
        for call in calls.values():
            call.key = _key(call, inline_calls, metas, states.get(call.index))
        chosen = _choose(calls)
        groups: dict[Any, list[_Call]] = {}
        for call in chosen:
            groups.setdefault(call.key, []).append(call)
        groups = {k: g for k, g in groups.items() if len(g) >= 2
                  and _safe_subgraph(_subgraph(g[0]), g[0], mode, metas)}
        if not groups:
            return gm, []
        return _rewrite(gm, groups, inline_calls)
    finally:
        for node in gm.graph.nodes:
            node.meta.pop("example_value", None)


def _calls_of(gm: fx.GraphModule, n_calls: int) -> dict[int, _Call]:
    """Each recorded call with its nodes, inputs and outputs (get_attr nodes are
    never members: parameters and buffers are operands)."""
    calls: dict[int, _Call] = {}
    for node in gm.graph.nodes:
        stack = node.meta.get(CALLS_META, ())
        if node.op not in ("call_function", "call_method") or not stack:
            continue
        for depth, index in enumerate(stack):
            if 0 <= index < n_calls:
                call = calls.setdefault(index, _Call(index, depth, tuple(stack[:depth])))
                call.members.append(node)
    for call in calls.values():
        members = set(call.members)
        seen: set[fx.Node] = set()
        for node in call.members:
            for arg in node.all_input_nodes:
                if arg not in members and arg not in seen:
                    seen.add(arg)
                    call.inputs.append(arg)
        call.outputs = [n for n in call.members if any(u not in members for u in n.users)]
    return calls


def _contiguous(call: _Call) -> bool:
    """Are the call's nodes one stretch of the graph (get_attr nodes aside)?"""
    members = set(call.members)
    node: Any = call.members[0]
    while node is not call.members[-1]:
        node = node.next
        if node.op != "get_attr" and node not in members:
            return False
    return True


def _recorded_metas(gm: fx.GraphModule, example_inputs: list[Any],
                    calls: Any) -> Optional[dict[fx.Node, Optional[tuple]]]:
    """Each node's value metadata as the capture's run recorded it (capture/nodes.py:
    placeholders from the example inputs, get_attr nodes from the graph's attributes,
    op results from `meta[VALUE_META]`), without running the graph again on fakes; None
    when a candidate call's input or output has none (the caller runs the graph on
    fakes instead)."""
    metas: dict[fx.Node, Optional[tuple]] = {}
    inputs = iter(example_inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = next(inputs, None)
            metas[node] = value_meta(value) if isinstance(value, torch.Tensor) else None
        elif node.op == "get_attr":
            value = backend_form._attr(gm, str(node.target))
            metas[node] = value_meta(value) if isinstance(value, torch.Tensor) else None
        elif VALUE_META in node.meta:
            metas[node] = node.meta[VALUE_META]
    for call in calls:
        if len(call.members) >= MIN_OPS and any(
                metas.get(n) is None for n in call.inputs + call.outputs):
            return None
    return metas


def _key(call: _Call, inline_calls: list, metas: dict, state: Any) -> Any:
    """What two calls must have equal to share a subgraph, or None if this call
    cannot be one.  `state`: the grad mode and autocast regions the graph has
    around the call (`_global_states`)."""
    if len(call.members) < MIN_OPS or not call.outputs or not _contiguous(call):
        return None
    if any(n.meta.get(META_CHANGED) for n in call.inputs):
        return None   # what the call saw of an input is not what was recorded
    path, cls, code = inline_calls[call.index]
    if path is None or code is None:
        return None
    position = {n: ("node", i) for i, n in enumerate(call.members)}
    position.update({n: ("input", i) for i, n in enumerate(call.inputs)})
    nodes = []
    for node in call.members:
        if node.op == "call_function" and (
                not backend_form._runs_torch_only(node.target)
                or isinstance(node.target, torch._ops.HigherOrderOperator)
                or backend_form._passes_code(node) or node.meta.get("nnscaler_opaque")):
            return None
        try:
            args = _canonical((node.args, node.kwargs), position)
        except _NotComparable:
            return None
        nodes.append((node.op, _target_key(node.target), args))
    described = tuple(metas.get(n) for n in call.inputs + call.outputs)
    if any(d is None for d in described):
        return None
    outputs = tuple(position[n] for n in call.outputs)
    return (cls, code, state, tuple(nodes), described, outputs)


def _global_states(gm: fx.GraphModule, calls: Any) -> dict[int, Any]:
    """Per call, the grad mode and the autocast regions open around it, as the
    graph's own nodes set them (capture/global_state.py): the last
    `_set_grad_enabled(mode)` before it and the arguments of each `_enter_autocast`
    not yet exited.  The subgraph is traced once, in the state of one call: calls
    in other states (some blocks under autocast) must not share it."""
    firsts: dict[fx.Node, list[int]] = {}   # a call's first node may be its layers' too
    for call in calls:
        if call.members:
            firsts.setdefault(call.members[0], []).append(call.index)
    states: dict[int, Any] = {}
    grad: Any = None   # as the graph was entered
    regions: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        for index in firsts.get(node, ()):
            states[index] = (grad, tuple(regions.values()))
        if node.op != "call_function":
            continue
        if node.target is torch._C._set_grad_enabled:
            grad = node.args
        elif node.target is torch.amp.autocast_mode._enter_autocast:
            try:
                regions[node] = _canonical(node.args, {})
            except (KeyError, _NotComparable):   # an argument the graph computes
                regions[node] = ("computed", node)
        elif node.target is torch.amp.autocast_mode._exit_autocast and node.args:
            regions.pop(node.args[0], None)
    return states


class _NotComparable(Exception):
    pass


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)


def _canonical(value: Any, position: dict[fx.Node, Any]) -> Any:
    """An argument with nodes replaced by their place in the call, constants with
    their type (1, 1.0 and True are not the same argument), floats by their bits
    (0.0 and -0.0 are not the same argument either)."""
    if isinstance(value, fx.Node):
        return position[value]
    if type(value) is float:   # by its bits: 0.0 == -0.0, and nan != nan
        return (float, value.hex())
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_canonical(v, position) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _canonical(v, position)) for k, v in value.items()))
    if isinstance(value, slice):
        return (slice, _canonical((value.start, value.stop, value.step), position))
    if value is Ellipsis:
        return (type(value),)
    raise _NotComparable(value)


def _target_key(target: Any) -> Any:
    return target if isinstance(target, str) else ("id", id(target), target)


def _choose(calls: dict[int, _Call]) -> list[_Call]:
    """From the outside in: at each depth, the calls outside every chosen one whose
    key another such call at that depth has."""
    chosen: list[_Call] = []
    chosen_ids: set[int] = set()
    for depth in sorted({c.depth for c in calls.values()}):
        level = [c for c in calls.values() if c.depth == depth and c.key is not None
                 and not chosen_ids.intersection(c.parents)]
        counts: dict[Any, int] = {}
        for call in level:
            counts[call.key] = counts.get(call.key, 0) + 1
        for call in level:
            if counts[call.key] >= 2:
                chosen.append(call)
                chosen_ids.add(call.index)
    return chosen


def _subgraph(call: _Call) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(call.inputs):
        env[node] = graph.placeholder(f"arg{i}")
    for node in call.members:
        env[node] = graph.node_copy(node, env.__getitem__)
        for name in (CALLS_META, "nn_module_stack"):
            env[node].meta.pop(name, None)
    graph.output(tuple(env[n] for n in call.outputs))
    return fx.GraphModule(torch.nn.Module(), graph, class_name="SharedBlock")


def _safe_subgraph(sub: fx.GraphModule, call: _Call, mode: Any, metas: dict) -> bool:
    """Can invoke_subgraph stand for it: no input written, no output a view of an
    input or of another output?"""
    with mode:
        fakes = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                 .requires_grad_(requires_grad)
                 for shape, stride, _, dtype, device, requires_grad
                 in (metas[n] for n in call.inputs)]
    versions = [f._version for f in fakes]
    grad = torch.is_grad_enabled()
    try:
        with mode:
            outputs = sub(*fakes)
    except Exception:
        return False
    finally:
        torch._C._set_grad_enabled(grad)
    if any(f._version != v for f, v in zip(fakes, versions)):
        return False
    storages = [f.untyped_storage()._cdata for f in fakes]
    seen: set[int] = set()
    for out in outputs:
        storage = out.untyped_storage()._cdata
        if storage in storages or storage in seen:
            return False
        seen.add(storage)
    return True


def _rewrite(gm: fx.GraphModule, groups: dict[Any, list[_Call]],
             inline_calls: list) -> tuple[fx.GraphModule, list[SharedBlock]]:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    starts: dict[fx.Node, tuple[_Call, str]] = {}
    skipped: set[fx.Node] = set()
    shared: list[SharedBlock] = []
    for calls in groups.values():
        identifier = f"nnscaler_block_{next(_identifiers)}"
        sub = _subgraph(calls[0])
        attr = identifier
        gm.add_module(attr, sub)   # the new GraphModule copies what its graph reads
        _, cls, _ = inline_calls[calls[0].index]
        shared.append(SharedBlock(identifier, [inline_calls[c.index][0] or "?" for c in calls],
                                  cls.__qualname__, len(calls[0].members)))
        for call in calls:
            starts[call.members[0]] = (call, attr)
            skipped.update(call.members)
    nodes = list(gm.graph.nodes)
    for node in nodes:   # placeholders, then every get_attr: operands come first
        if node.op == "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    for node in nodes:
        if node.op == "get_attr":
            env[node] = graph.node_copy(node, env.__getitem__)
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node in starts:
            call, attr = starts[node]
            sub_node = graph.get_attr(attr)
            invoke = graph.call_function(
                torch.ops.higher_order.invoke_subgraph,
                (sub_node, attr, *(env[n] for n in call.inputs)))
            for i, out in enumerate(call.outputs):
                env[out] = graph.call_function(operator.getitem, (invoke, i))
                env[out].meta = {k: v for k, v in out.meta.items() if k != "example_value"}
            continue
        if node in skipped:
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    return new, shared
