"""A captured graph handed to a `torch.compile` backend in the form Dynamo hands it.

Inductor keeps two caches across processes: AOTAutograd's (the forward and backward
graphs of a whole capture) and the FX graph cache (each graph Inductor lowers).  Both
refuse a graph they cannot key soundly, and both were written for what Dynamo gives a
backend.  Ours differed from it in two ways, and each made both caches refuse every
graph of ours (`autograd_cache_bypass`, `fxgraph_cache_bypass` in
`torch._dynamo.utils.counters`):

- No `ShapeEnv`.  Dynamo compiles every graph, static ones included, in a
  `TracingContext` whose `FakeTensorMode` has a `ShapeEnv`; AOTAutograd fakes the
  example inputs in that mode.  The FX graph cache stores the guards a compile adds
  with the compiled graph and re-checks them on a hit, so it needs one ("Bypassing FX
  Graph Cache because 'No shape env'").  A static capture handed real tensors and no
  context: AOTAutograd made a mode without one.  Now a static capture is compiled in
  a `TracingContext` of its own mode, with a `ShapeEnv` and its inputs faked with
  static sizes (registered with that mode first, as Dynamo does: "Tensor Fakification
  and Symbol Caching"), so nothing becomes symbolic that was not; the backend still
  gets the real tensors as example inputs, as torch.compile gives them.  A symbolic
  capture's inputs are fakes of its own `ShapeEnv` already; it gets that mode's
  context.
- No `example_value`.  AOTAutograd's cache takes a `call_method` node as safe only on
  a receiver it knows to be a tensor, by the `meta["example_value"]` Dynamo puts on
  every node ("Unsupported call_method target ..."); our nodes had none.  Now the
  graph is run once on fakes of its mode (inputs, parameters, buffers, constants) and
  each node's value is recorded there, as Dynamo records it.

What either cache would key without knowing what runs is kept out of them: a graph
that calls user code (a submodule opaque for its hooks, a `register_op` op, an
autograd Function, a function of ours) is not run on fakes (its Python would run) and
keeps no `example_value`; it calls a function no cache takes as safe
(capture/results.py makes every opaque submodule call `module_calls.module_call`, not
a `call_module` node, which AOTAutograd's cache would take for a torch layer), so
AOTAutograd's cache refuses it and only Inductor's cache of the graph AOTAutograd
traced from it (aten ops, keyed by what they are) applies.
"""

from __future__ import annotations

import contextlib
import operator
import types
from typing import Any, Iterator, Optional

import torch
import torch.utils._pytree as pytree
import torch.fx as fx
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake
from torch.fx.experimental.symbolic_shapes import ShapeEnv


def fake_mode_of(example_inputs: list[Any]) -> Any:
    """The fake mode of a symbolic capture's example inputs (fakes of its `ShapeEnv`,
    or symbolic ints only: a mode of their `ShapeEnv`), or None (real tensors)."""
    for value in example_inputs:
        if isinstance(value, FakeTensor):
            return value.fake_mode
    for value in example_inputs:
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return FakeTensorMode(shape_env=value.node.shape_env)
    return None


@contextlib.contextmanager
def as_dynamo_hands_it(gm: fx.GraphModule, example_inputs: list[Any]) -> Iterator[None]:
    """For the backend call: a `TracingContext` of the capture's fake mode (a static
    capture's made here, with a `ShapeEnv`, its inputs faked with static sizes) and
    `meta["example_value"]` on the nodes of a graph that runs torch only.  An existing
    context (a capture made while torch.compile traces) is left as it is."""
    if TracingContext.try_get() is not None:
        yield
        return
    mode = fake_mode_of(example_inputs)
    if mode is None:
        mode = _static_mode(example_inputs)
    if mode is None:   # an input that cannot be faked: hand it over as before
        yield
        return
    annotate_example_values(gm, mode, example_inputs)
    with tracing(TracingContext(mode)):
        yield


def _static_mode(example_inputs: list[Any]) -> Optional[Any]:
    """A `FakeTensorMode` with a `ShapeEnv` in which every tensor input is already
    faked with its own sizes and strides: AOTAutograd finds these fakes (the mode
    keeps one per real tensor) instead of making symbolic ones."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    try:
        for value in example_inputs:
            if isinstance(value, torch.Tensor):
                mode.from_tensor(value, static_shapes=True)
    except Exception:  # a tensor fake tensors do not support (quantized, ...)
        return None
    return mode


def _runs_torch_only(target: Any) -> bool:
    """Is `target` torch's own (an operator, a C binding, a layer's function in
    torch), which Dynamo puts in graphs too?  Anything else written in Python is the
    user's (or ours) and is not run on fakes."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if isinstance(target, types.BuiltinFunctionType):
        return True   # C functions: torch's bindings, operator, math
    if isinstance(target, types.FunctionType):
        module = getattr(target, "__module__", None) or ""
        return module == "torch" or (module.startswith("torch.")
                                     and not module.startswith("torch.testing"))
    return target in (operator.getitem,)


def _passes_code(node: fx.Node) -> bool:
    """Does the node hand a function or a module to what it calls (torch code that
    would call it back: the user's Python)?"""
    found = False

    def visit(value: Any) -> Any:
        nonlocal found
        found = found or isinstance(value, (types.FunctionType, types.MethodType,
                                            torch.nn.Module))
        return value

    fx.node.map_aggregate((node.args, node.kwargs), visit)
    return found


def _plain_graph(gm: fx.GraphModule) -> bool:
    """Does running `gm` on fakes run only torch (and its cond branches, the same)?"""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            return False
        if node.op == "call_function" and (node.meta.get("nnscaler_opaque")
                                           or not _runs_torch_only(node.target)
                                           or _passes_code(node)):
            return False
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            for arg in node.args:
                if isinstance(arg, fx.Node) and arg.op == "get_attr":
                    sub = _attr(gm, str(arg.target))
                    if isinstance(sub, fx.GraphModule) and not _plain_graph(sub):
                        return False
    return True


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


class _FakePropagation(fx.Interpreter):
    """Runs the graph on fakes of `mode`, recording each node's value.

    A block compiled once (runners/block_reuse.py) is called once per instance with
    operands of equal metadata (its group's key): only its first call runs the higher-
    order op on fakes (which, with inputs requiring grad, retraces the subgraph per
    call: 5.5 of the 7.3 s of a 48-block GPT's training capture); each later call's
    results are fresh fakes with the first one's metadata, storage size and offset
    included."""

    def __init__(self, gm: fx.GraphModule, mode: Any) -> None:
        super().__init__(gm)
        self.mode = mode
        self.autocast: list[Any] = []
        self.blocks: dict[tuple, Any] = {}   # (identifier, operands' metadata) -> results

    def run_node(self, n: fx.Node) -> Any:
        key = _block_call_key(n, self.env) if n.target is _INVOKE_SUBGRAPH else None
        seen = self.blocks.get(key) if key is not None else None
        if seen is not None:
            result = pytree.tree_map_only(torch.Tensor, _same_metadata, seen)
        else:
            result = super().run_node(n)
            if key is not None:
                self.blocks[key] = result
        n.meta["example_value"] = result
        if n.op == "call_function" and n.target is torch.amp.autocast_mode._enter_autocast:
            self.autocast.append(result)
        elif n.op == "call_function" and n.target is torch.amp.autocast_mode._exit_autocast:
            if self.autocast:
                self.autocast.pop()
        return result

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor):
            return self.mode.from_tensor(value, static_shapes=True)
        return value


_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def _block_call_key(n: fx.Node, env: dict) -> Optional[tuple]:
    """What an invoke_subgraph call's results follow from: its identifier, grad mode and
    each operand's metadata (a non-tensor by value); None for one that cannot be told
    (symbolic sizes)."""
    parts: list[Any] = [n.args[1], torch.is_grad_enabled()]
    for arg in n.args[2:]:
        value = env[arg] if isinstance(arg, fx.Node) else arg
        if isinstance(value, torch.Tensor):
            described = tensor_metadata(value)
            if described is None:
                return None
            parts.append(described)
        elif isinstance(value, (int, float, bool, str, type(None))):
            parts.append((type(value), value))
        else:
            return None
    return tuple(parts)


def tensor_metadata(tensor: torch.Tensor) -> Optional[tuple]:
    """(shape, stride, storage offset, dtype, device, requires_grad) of a tensor whose
    attributes are torch's own (a plain tensor, a fake one); None for symbolic sizes
    or a layout without strides."""
    try:
        shape, stride = tuple(tensor.shape), tensor.stride()
        if any(type(d) is not int for d in (*shape, *stride)):
            return None
        return (shape, stride, tensor.storage_offset(), tensor.dtype, tensor.device,
                tensor.requires_grad)
    except Exception:   # a tensor without strides (sparse, nested): not described
        return None


def _same_metadata(t: torch.Tensor) -> torch.Tensor:
    """A fresh fake with `t`'s sizes, strides, dtype, device, storage size and offset
    and requires_grad (a view of a fresh base when its storage is larger than it)."""
    fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device,
                                requires_grad=t.requires_grad)
    nbytes = t.untyped_storage().nbytes()
    if t.storage_offset() == 0 and fresh.untyped_storage().nbytes() == nbytes:
        return fresh
    base = torch.empty(nbytes // t.element_size(), dtype=t.dtype, device=t.device,
                       requires_grad=t.requires_grad)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def annotate_example_values(gm: fx.GraphModule, mode: Any, example_inputs: list[Any]) -> bool:
    """`meta["example_value"]` on every node of `gm`: its value on fakes of `mode`
    (what Dynamo records), for a graph that runs torch only.  Global state the graph
    sets (grad mode, autocast) is as it was afterwards, also when a node raises; then
    the graph keeps no example values (the caches refuse it, as before).  Returns
    whether it annotated."""
    if not _plain_graph(gm):
        return False
    fakes = [mode.from_tensor(v, static_shapes=True)
             if isinstance(v, torch.Tensor) and not _is_fake(v) else v
             for v in example_inputs]
    interpreter = _FakePropagation(gm, mode)
    grad = torch.is_grad_enabled()
    try:
        with mode:
            interpreter.run(*fakes)
            _annotate_subgraphs(gm, mode)
    except Exception:
        for graph in [gm] + [s for s in gm.children() if isinstance(s, fx.GraphModule)]:
            for node in graph.graph.nodes:
                node.meta.pop("example_value", None)
        return False
    finally:
        for context in reversed(interpreter.autocast):
            torch.amp.autocast_mode._exit_autocast(context)
        torch._C._set_grad_enabled(grad)
    return True


def _annotate_subgraphs(gm: fx.GraphModule, mode: Any) -> None:
    """The nodes of each subgraph an `invoke_subgraph` node calls (a block compiled
    once, runners/block_reuse.py) get their `example_value` too, from its first call,
    as Dynamo gives them."""
    done: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph:
            target = str(node.args[0].target)
            if target not in done:
                done.add(target)
                operands = [a.meta["example_value"] if isinstance(a, fx.Node) else a
                            for a in node.args[2:]]
                _FakePropagation(_attr(gm, target), mode).run(*operands)


def _is_fake(value: Any) -> bool:
    return is_fake(value)
