"""nnscaler-eval as the capture front end of Microsoft nnScaler's `parallelize`.

    gm = nnscaler_eval.export_for_nnscaler(model, x, batch={...})  # nnScaler's form
    pm = nnscaler_eval.parallelize(model, {'x': x, ...}, 'dp', ComputeConfig(1, 1), ...)

`export_for_nnscaler` takes the same capture `nnscaler.export` makes and rewrites it into
the form nnScaler's parser (`FxModuleParser.parse`) consumes:

- one placeholder per forward parameter, named after it; tensors nested in a parameter
  (dicts, lists, tuples) are reached through `operator.getitem`; a non-tensor argument
  stays an input (the graph is specialised on its value, as every capture is);
- a training flag is `get_attr` of `<path>.training` (nnScaler turns it into a read of
  `self.training` at run time), `ifexpr` nodes call nnScaler's
  `nnscaler.runtime.function.ifexpr`;
- tensor arguments that `__torch_function__` handed over as keywords (`F.batch_norm(...,
  weight=w, bias=b)`) are positional again, as the user wrote them;
- an op registered with nnScaler (through its `register_op` or ours) calls the function
  nnScaler's registry holds, so the parser maps it to its IRDimops;
- buffers keep their persistence (`_non_persistent_buffers_set` of their module);
- every node carries nnScaler's metadata: `tensor_meta`, `type`, `op_context` (grad
  mode and autocast state while the node ran) and `frame_record` (the user's line);
- an `if` on a tensor the capture turned into `torch.cond` (capture/branches.py)
  becomes, when neither side calls anything (the seed's rule for conditional
  expressions: no calls, no side effects), both sides' ops inline and one
  `ifexpr(test, true_value, false_value)` per value the `if` produces (both sides
  are then evaluated, as nnScaler's ifexpr always does);
- `torch.cond` otherwise, ops registered with nnscaler-eval only, and other forms
  nnScaler cannot express raise `ExportError` naming the construct and the user's
  `file:line`.

Metadata comes from running the rewritten graph once more (an fx Interpreter). Module
buffers and the RNG state are restored after the capture and that run: unlike
`nnscaler.export`, this export leaves the module as it found it (nnScaler saves the
module's state once the graph is made, and BatchNorm statistics must not have moved).

`parallelize` calls nnScaler's `parallelize` with its graph front end,
`nnscaler.graph.parser.to_fx_graph` (looked up at call time by `nnscaler/parallel.py`),
swapped for `export_for_nnscaler` for the duration of the call.
"""
from __future__ import annotations

import collections
import contextlib
from collections import namedtuple
import inspect
import linecache
import operator
import re
import sys
import threading
import types
import warnings
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from nnscaler_eval import _C, microsoft_nnscaler, register_op
from nnscaler_eval.capture import Capture
from nnscaler_eval.export import (
    ExportedGraphModule,
    ExportError,
    _capture_for_export,
    _module_path,
    _plain_structure,
    keep_buffer_persistence,
)
from nnscaler_eval.register_op import nnscaler_runtime_function
from nnscaler_eval.runtime import ifexpr
from nnscaler_eval.tracing import trace_patches

__all__ = ["export_for_nnscaler", "parallelize", "nnscaler_available"]

_seam_lock = threading.RLock()


def nnscaler_available() -> bool:
    """Is Microsoft nnScaler installed (its parser importable)?"""
    return microsoft_nnscaler.available()


def _require_nnscaler(what: str) -> None:
    if not nnscaler_available():
        raise ImportError(f"{what} needs Microsoft nnScaler installed beside nnscaler-eval "
                          "(https://github.com/microsoft/nnscaler)")

    register_op.attach_nnscaler()  # nnscaler imported some other way: one registry


def export_for_nnscaler(module: nn.Module, *args: Any, dynamic_dims: Optional[dict] = None,
                        **kwargs: Any) -> fx.GraphModule:
    """Capture `module(*args, **kwargs)` into the GraphModule nnScaler's parser consumes.

    `dynamic_dims` ({argument name: dimension or dimensions}) or `mark_dynamic` marks
    keep those sizes symbolic: the graph reads them with `size` nodes where the
    forward uses them, as `nnscaler.export` does."""
    _require_nnscaler("export_for_nnscaler()")
    with _state_kept(module):
        result, bound = _capture_for_export(module, args, kwargs, "export_for_nnscaler()",
                                            dynamic_dims, python_values=True)
        gm = _nnscaler_graph(result, bound, module)
        _add_metadata(gm, module, bound)
    return gm


@contextlib.contextmanager
def _state_kept(module: nn.Module) -> Iterator[None]:
    """Buffers (BatchNorm statistics) and the RNG as they were: nnScaler saves the
    module's state after tracing, and a trace is not a training step."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    rng = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(rng)
        with torch.no_grad():
            for buffer, saved in buffers:
                if buffer.shape == saved.shape:
                    buffer.copy_(saved)


def parallelize(*args: Any, **kwargs: Any) -> Any:
    """`nnscaler.parallelize(...)` (same arguments) with nnscaler-eval's capture as the
    graph front end instead of nnScaler's tracer."""
    _require_nnscaler("parallelize()")
    nnscaler_parser = microsoft_nnscaler.module("graph.parser")
    _rewrite_inplace_ops = microsoft_nnscaler.module("graph.parser.converter")._rewrite_inplace_ops

    def to_fx_graph(model: nn.Module, dummy_input: dict[str, Any]) -> fx.GraphModule:
        if not isinstance(dummy_input, dict):
            raise TypeError("parallelize(): dummy_forward_args must be a dict of forward "
                            f"argument names to values, not {type(dummy_input).__name__}")
        gm = export_for_nnscaler(model, **dummy_input)
        _rewrite_inplace_ops(gm)  # what nnScaler's to_fx_graph does after its trace
        return gm

    def through_our_seam() -> Any:
        original = nnscaler_parser.to_fx_graph
        nnscaler_parser.to_fx_graph = to_fx_graph
        try:
            return microsoft_nnscaler.module("parallel").parallelize(*args, **kwargs)
        finally:
            nnscaler_parser.to_fx_graph = original

    return _C.call_holding(_seam_lock, through_our_seam)


# -- the rewrite into nnScaler's form --------------------------------------------------

def _where(node: fx.Node) -> str:
    return str(node.meta.get("source_loc", "<unknown>"))


def _nnscaler_graph(result: Capture, bound: inspect.BoundArguments,
                    module: nn.Module) -> fx.GraphModule:
    nnscaler_ifexpr = microsoft_nnscaler.module("runtime.function.function").ifexpr

    source = result.graph_module
    assert source is not None and result.runner_spec is not None
    graph = fx.Graph()
    params = list(bound.signature.parameters.values())[1:]  # without self
    param_nodes: dict[str, fx.Node] = {}
    for param in params:
        target = param.name
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            target = "*" + param.name
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            target = "**" + param.name
        if param.kind is inspect.Parameter.VAR_POSITIONAL and bound.arguments.get(param.name):
            # (nnScaler's tracer refuses them too: "*args is not supported")
            raise ExportError(f"export_for_nnscaler: {target} of {_forward_name(module)} is "
                              "given values; nnScaler takes no *args inputs")
        param_nodes[param.name] = graph.placeholder(target)

    env = _Env(graph)
    attrs: dict[str, Any] = {}
    flags = iter(result.training_inputs)
    inlined = {node for node in source.graph.nodes if _as_ifexprs(node)}
    for old in source.graph.nodes:
        if old.op == "placeholder":
            info = old.meta.get("nnscaler_input", 0)
            if info is None:  # a training flag
                path = _module_path(module, next(flags))
                target = f"{path}.training" if path else "training"
                attrs[target] = _fetch(module, target)
                # where the forward first reads it, as nnScaler's tracer records
                # `self.training` (its solvers count operators by position)
                env.deferred[old] = (target, ())
            else:
                param = params[info.slot - 1] if 0 < info.slot <= len(params) else None
                if param is not None and param.kind is inspect.Parameter.VAR_KEYWORD:
                    raise ExportError(
                        f"export_for_nnscaler: the forward reads a tensor from **{param.name} "
                        f"({_forward_name(module)}); nnScaler's generated code cannot read "
                        f"from **kwargs: make it a named parameter")
                node = param_nodes[result.slot_names[info.slot]]
                if info.keys:
                    # `sample['y']` where the forward first reads it, as nnScaler's
                    # tracer records it (its graph's order is the forward's)
                    env.deferred[old] = (node, info.keys)
                else:
                    env[old] = node
            continue
        if old.op == "output":
            flat = old.args[0]
            output = _output(result, flat, env, param_nodes)
            graph.output(output)
            continue
        if old.op == "get_attr" and old.users and all(u in inlined for u in old.users):
            continue   # a branch graph of an `if` written as ifexprs
        if old in inlined:
            env[old] = _inline_ifexprs(graph, old, source, env, nnscaler_ifexpr)
            continue
        if (old.op == "call_function" and old.target is operator.getitem
                and old.args[0] in inlined):
            env[old] = env[old.args[0]][old.args[1]]
            continue
        new = graph.node_copy(old, lambda n: env[n])
        env[old] = new
        if new.op == "get_attr":
            attrs[new.target] = _fetch(module, new.target, source)
        elif new.op == "call_function":
            _retarget(new, nnscaler_ifexpr)
        elif new.op == "call_module":
            raise ExportError(f"export_for_nnscaler: {new.target} is called as an opaque "
                              f"module (it has hooks) at {_where(old)}; nnScaler's parser "
                              "needs its forward traced: remove the hooks to export")
    _drop_unused_reads(graph)
    for node in graph.nodes:
        # nnScaler's tracer gives every node its module scope, empty at the root (the
        # tracer sets it on the nodes it records; those made here are the root's)
        node.meta.setdefault("nn_module_stack", collections.OrderedDict())
    graph.lint()
    # named after the module's class, as nnScaler's tracer names its GraphModule (the
    # IRGraph it parses into takes that name)
    gm = ExportedGraphModule(attrs, graph, class_name=type(module).__name__)
    keep_buffer_persistence(gm, module)
    if result.branched_training:
        names = ", ".join(f"{_module_path(module, m) or type(m).__name__}.training={v}"
                          for m, v in result.branched_training)
        warnings.warn(f"export_for_nnscaler: the forward branches on `training` ({names}); "
                      "the graph holds the branch taken in that mode only (nnScaler's rule "
                      "for `if` statements); write `a if self.training else b` to keep both",
                      stacklevel=4)
    return gm


def _as_ifexprs(node: fx.Node) -> bool:
    """A torch.cond node made from an `if` whose sides call nothing (capture/branches.py
    records that): nnScaler's ifexpr can hold it."""
    info = node.meta.get("nnscaler_if")
    return (node.op == "call_function" and node.target is torch.ops.higher_order.cond
            and isinstance(info, dict) and bool(info.get("ifexpr_ok")))


def _inline_ifexprs(graph: fx.Graph, node: fx.Node, source: fx.GraphModule,
                    env: dict[fx.Node, Any], nnscaler_ifexpr: Any) -> tuple[fx.Node, ...]:
    """Both branch graphs of `node` copied into `graph` on its operands, and one
    `ifexpr(test, true_i, false_i)` per output."""
    pred, true_attr, false_attr, operands = node.args
    sides = []
    for attr in (true_attr, false_attr):
        branch = getattr(source, str(attr.target))   # type: ignore[union-attr]
        inputs = [n for n in branch.graph.nodes if n.op == "placeholder"]
        values: dict[fx.Node, Any] = {p: env[o] for p, o in zip(inputs, operands)}  # type: ignore[arg-type]
        out: Any = None
        for inner in branch.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                out = fx.node.map_arg(inner.args[0], values.__getitem__)
                continue
            if inner.op == "get_attr":
                raise ExportError(f"export_for_nnscaler: the `if` at {_where(node)} reads "
                                  f"{inner.target} inside a side, which nnScaler's ifexpr "
                                  "cannot hold")
            copied = graph.node_copy(inner, values.__getitem__)
            copied.meta = dict(inner.meta)
            _retarget(copied, nnscaler_ifexpr)
            values[inner] = copied
        sides.append(tuple(out))
    test = env[pred]   # type: ignore[index]
    results = []
    for true_value, false_value in zip(*sides):
        choice = graph.call_function(nnscaler_ifexpr, (test, true_value, false_value))
        choice.meta = {k: v for k, v in node.meta.items()
                       if k in ("source_loc", "stack_trace", "nnscaler_source")}
        results.append(choice)
    return tuple(results)


# Nodes that only read a value (an item of an op's outputs, a shape, Python's operators
# on numbers): with no users they are dropped, as nnScaler's tracer drops them, so that
# `(n, _) = x.shape` or an output left unpacked adds no operator to nnScaler's graph.
_READ_METHODS = frozenset({"size", "get", "item", "dim"})
_READ_FUNCTIONS = frozenset({
    getattr, operator.getitem, operator.add, operator.sub, operator.mul,
    operator.truediv, operator.floordiv, operator.mod, operator.pow, operator.neg,
    operator.pos, operator.abs, operator.eq, operator.ne, operator.lt, operator.le,
    operator.gt, operator.ge, operator.and_, operator.or_, operator.xor,
    operator.invert, operator.not_, operator.lshift, operator.rshift,
})


def _drop_unused_reads(graph: fx.Graph) -> None:
    for node in reversed(graph.nodes):
        if node.users or node.op not in ("call_function", "call_method"):
            continue
        if node.op == "call_method":
            pure = node.target in _READ_METHODS
        else:
            pure = node.target in _READ_FUNCTIONS
        if pure:
            graph.erase_node(node)


def _forward_name(module: nn.Module) -> str:
    return f"{type(module).__qualname__}.forward"


def _fetch(module: nn.Module, target: str, fallback: Optional[nn.Module] = None) -> Any:
    value: Any = module
    try:
        for part in target.split("."):
            value = getattr(value, part)
        return value
    except AttributeError:
        if fallback is None:
            raise
    value = fallback  # constants the capture keeps on its own GraphModule
    for part in target.split("."):
        value = getattr(value, part)
    return value


class _Env(dict):
    """The new graph's node for each node of the capture's.  Inputs are made where a
    node first uses them (`deferred`), as nnScaler's tracer records them: a training
    flag (its attribute path) as a get_attr node, a value read from inside an argument
    (the argument's node and the keys) as getitem nodes."""

    def __init__(self, graph: fx.Graph) -> None:
        super().__init__()
        self.graph = graph
        self.deferred: dict[fx.Node, tuple[fx.Node | str, tuple]] = {}

    def __missing__(self, old: fx.Node) -> fx.Node:
        source, keys = self.deferred.pop(old)
        node = self.graph.get_attr(source) if isinstance(source, str) else source
        for key in keys:
            node = _key_access(self.graph, node, key)
        self[old] = node
        return node


def _key_access(graph: fx.Graph, node: fx.Node, key: Any) -> fx.Node:
    if isinstance(key, pytree.SequenceKey):
        return graph.call_function(operator.getitem, (node, key.idx))
    if isinstance(key, pytree.MappingKey):
        return graph.call_function(operator.getitem, (node, key.key))
    if isinstance(key, pytree.GetAttrKey):
        return graph.call_function(getattr, (node, key.name))
    raise ExportError(f"export_for_nnscaler: cannot express the input path key {key!r}")


def _retarget(node: fx.Node, nnscaler_ifexpr: Any) -> None:
    target = node.target
    if target is ifexpr:
        node.target = nnscaler_ifexpr
        return
    if isinstance(target, torch._ops.HigherOrderOperator):
        construct = "torch.cond" if target is torch.ops.higher_order.cond else str(target)
        info = node.meta.get("nnscaler_if")
        if isinstance(info, dict):
            construct = ("an `if` on a tensor (captured as torch.cond; a side calls "
                         "something, so it is not an ifexpr)")
        loop = node.meta.get("nnscaler_while")
        if isinstance(loop, dict):
            construct = ("a `while` loop on a tensor (captured as while_loop; nnScaler's "
                         "graph has no loops)" if loop.get("converted_from") == "bytecode"
                         else "torch while_loop (nnScaler's graph has no loops)")
        raise ExportError(f"export_for_nnscaler: {construct} at {_where(node)} cannot be "
                          "expressed in nnScaler's graph (it has no conditional op); use "
                          "`a if self.training else b` or a registered op")
    function_class = getattr(target, "__autograd_function__", None)
    if function_class is not None:
        # nnScaler knows a custom autograd op by `Cls.apply` itself, bound to its class
        node.target = function_class.apply
        return
    if getattr(target, "__nnscaler_op__", None) is not None or hasattr(target, "op_name"):
        runtime_fn = nnscaler_runtime_function(target)
        if runtime_fn is None:
            reason = getattr(target, "__nnscaler_refused__", None) or "not handed to it"
            raise ExportError(
                f"export_for_nnscaler: the op {getattr(target, 'op_name', target)!r} at "
                f"{_where(node)} is registered with nnscaler-eval only, not with nnScaler "
                f"({reason}); register it once, at module level of an importable module "
                "(nnScaler refuses ops of __main__ and a second name for one function)")
        node.target = runtime_fn
        return
    _positional_tensor_kwargs(node)


def _positional_tensor_kwargs(node: fx.Node) -> None:
    """Tensor arguments passed by keyword (as `__torch_function__` normalises them) back
    to positions, filling the defaults between; nnScaler's codegen needs them there."""
    if not any(isinstance(v, fx.Node) for v in node.kwargs.values()):
        return
    try:
        signature = inspect.signature(node.target)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return
    positional = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    last = max((i for i, p in enumerate(positional)
                if isinstance(node.kwargs.get(p.name), fx.Node)), default=-1)
    if last < len(node.args):
        return
    args, kwargs = list(node.args), dict(node.kwargs)
    for param in positional[len(args): last + 1]:
        if param.name in kwargs:
            args.append(kwargs.pop(param.name))
        elif param.default is not param.empty:
            args.append(param.default)
        else:
            return  # a required argument missing: leave the call as it was recorded
    node.args, node.kwargs = tuple(args), kwargs


def _output(result: Capture, flat: Any, env: dict[fx.Node, fx.Node],
            param_nodes: dict[str, fx.Node]) -> Any:
    layout = result.runner_spec.output  # type: ignore[union-attr]
    flat_new = [env[n] if isinstance(n, fx.Node) else n for n in flat]
    leaves = layout.leaf_values(flat_new.__getitem__,
                                lambda slot: param_nodes[result.slot_names[slot]])
    if _plain_structure(layout.spec, named_tuples=True):
        return pytree.tree_unflatten(leaves, layout.spec)
    kind = layout.spec.context if layout.spec.type is namedtuple else layout.spec.type
    raise ExportError(f"export_for_nnscaler: the forward returns a {kind.__name__}, which "
                      "nnScaler's graph cannot hold as an output; return tensors, numbers "
                      "and shapes in tuples (named ones too), lists or dicts with str keys")


# -- nnScaler's metadata ---------------------------------------------------------------

_FRAME_NAME = re.compile(r", in (\S+)")


class _MetadataInterpreter(fx.Interpreter):
    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(target, str) and target.startswith("**"):
            return next(self.args_iter)   # the dict, handed over as one input
        return super().placeholder(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        metadata = microsoft_nnscaler.module("graph.tracer.metadata")
        extract_metadata = metadata.extract_metadata
        # the node's op context as it was when the trace made it (`with
        # nnscaler.constant_folding():` in the forward); _add_metadata puts it back after
        metadata._GLOBAL_OP_CONTEXT.constant_folding = n.meta.get("nnscaler_constant_folding")
        value = super().run_node(n)
        if n.op == "call_function" and n.target is operator.setitem \
                and isinstance(n.args[0], fx.Node):
            # as nnScaler's tracer records it: the tensor written into, which its
            # to_fx_graph then makes setitem's result (SSA)
            extract_metadata(self.env[n.args[0]], n)
        else:
            extract_metadata(value, n)
        return value


def _add_metadata(gm: fx.GraphModule, module: nn.Module, bound: inspect.BoundArguments) -> None:
    FrameRecord = microsoft_nnscaler.module("graph.tracer.frame_utils").FrameRecord

    inputs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = node.target.lstrip("*")
        value = bound.arguments.get(name)
        inputs.append(value)
    context = microsoft_nnscaler.module("graph.tracer.metadata")._GLOBAL_OP_CONTEXT
    before = context.constant_folding
    try:
        _MetadataInterpreter(gm).run(*inputs)  # buffers and RNG: restored by _state_kept
    finally:
        context.constant_folding = before
    _drop_state_changes(gm)
    for node in gm.graph.nodes:
        src = node.meta.get("nnscaler_source")
        if not src or not src[1]:
            continue
        filename, lineno = src
        match = _FRAME_NAME.search(node.meta.get("stack_trace", ""))
        node.meta["frame_record"] = FrameRecord(
            filename, lineno, linecache.getline(filename, lineno).strip(),
            match.group(1) if match else "forward")


def _drop_state_changes(gm: fx.GraphModule) -> None:
    """Remove the nodes that change grad mode and autocast (`with torch.no_grad():`,
    `torch.autocast(...)` in the forward, recorded by capture/global_state.py).

    nnScaler says a node's context with its `op_context` metadata, which the metadata
    run (the state nodes executing in their place) just recorded, and generates the
    `with` blocks from it; the nodes themselves would call our internals from its
    generated code."""
    changes = {trace_patches.REAL_SET_GRAD_ENABLED, trace_patches._set_grad_enabled,
               torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast}
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target in changes and not [
                user for user in node.users if user.target not in changes]:
            for user in list(node.users):
                gm.graph.erase_node(user)
            gm.graph.erase_node(node)
    gm.recompile()


class _CallableModule(types.ModuleType):
    """`nnscaler_eval.parallelize(...)` calls `parallelize` (the brief's spelling) while
    `from nnscaler_eval.parallelize import parallelize, export_for_nnscaler` still works:
    the module is callable."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return parallelize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
