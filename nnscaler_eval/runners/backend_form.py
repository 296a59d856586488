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
import torch.fx as fx


def fake_mode_of(example_inputs: list[Any]) -> Any:
    """The fake mode of a symbolic capture's example inputs (fakes of its `ShapeEnv`,
    or symbolic ints only: a mode of their `ShapeEnv`), or None (real tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

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
    from torch._guards import TracingContext, tracing

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
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

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
    """Runs the graph on fakes of `mode`, recording each node's value."""

    def __init__(self, gm: fx.GraphModule, mode: Any) -> None:
        super().__init__(gm)
        self.mode = mode
        self.autocast: list[Any] = []

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
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
    except Exception:
        for node in gm.graph.nodes:
            node.meta.pop("example_value", None)
        return False
    finally:
        for context in reversed(interpreter.autocast):
            torch.amp.autocast_mode._exit_autocast(context)
        torch._C._set_grad_enabled(grad)
    return True


def _is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(value)
