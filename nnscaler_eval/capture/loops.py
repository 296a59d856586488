"""`while` loops on tensors as one `torch.ops.higher_order.while_loop` node.

Two ways in: a `while` statement whose test is a tensor, found in the bytecode
(capture/branches.py opens it at its first test, runs its body once on fake tensors as a
function of the loop-carried locals, and binds the locals at the loop's exit to the
node's results), and an explicit `torch._higher_order_ops.while_loop(cond_fn, body_fn,
carried)` in a forward (`trace_while_loop`, which torch's own implementation would hand
to torch.compile: trace_patches routes it here instead).

The node is `while_loop(cond_graph, body_graph, carried, additional)`: both graphs take
`(*carried, *additional)`, the cond graph gives a one-element bool tensor, the body graph
the next carried values, with the shapes, dtypes and devices of the first (else the
loop is refused, with the variable that changed).  `additional` are the values of the
enclosing graph the graphs read (parameters, earlier results).  The eager runner calls
the node, which runs the loop in Python over the two graphs; backends get the node.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from nnscaler_eval import _C
from nnscaler_eval.capture import cond as torch_cond
from nnscaler_eval.capture.data_dependence import has_unbacked_size
from nnscaler_eval.capture.nodes import class_name
from nnscaler_eval.capture.results import Fallback, RecordingAborted
from nnscaler_eval.runners.codegen import InputPath, while_loop_in_python
from nnscaler_eval.runners.fx_source import release_source_with
from nnscaler_eval.tracing.locations import user_location

WHILE_LOOP = torch.ops.higher_order.while_loop


def changed_carry(names: Sequence[str], before: Sequence[tuple[Any, ...]],
                  after: Sequence[tuple[Any, ...]]) -> Optional[str]:
    """Why the carried values cannot be a while_loop's (their shape, dtype or device
    changes in an iteration), or None."""
    for name, a, b in zip(names, before, after):
        if a[0] != b[0]:
            return (f"{name} changes shape in an iteration ({list(a[0])} to {list(b[0])}); "
                    "a while_loop carries fixed shapes")
        if a[1:3] != b[1:3]:
            return (f"{name} changes dtype or device in an iteration ({a[1]} on {a[2]} to "
                    f"{b[1]} on {b[2]})")
    return None


def unbacked_output(metas: Sequence[tuple[Any, ...]]) -> bool:
    return any(has_unbacked_size(list(meta[0])) for meta in metas)


def first_input_graph(inputs: int, name: str) -> fx.GraphModule:
    """The cond graph of a loop whose test is carried: `(pred, *rest) -> pred` (a
    copy: a while_loop's cond must not hand back its input)."""
    graph = fx.Graph()
    params = [graph.placeholder(f"arg{i}") for i in range(inputs)]
    for index, param in enumerate(params):
        param.meta["nnscaler_input"] = InputPath(index, ())
    graph.output(graph.call_method("clone", (params[0],)))
    return _module(graph, name)


def _module(graph: fx.Graph, name: str, root: Any = None) -> fx.GraphModule:
    graph.lint()
    gm = fx.GraphModule(root if root is not None else {}, graph, class_name=class_name(name))
    _C.mark_skip(type(gm).forward.__code__)   # a backend calls it inside compiled code
    release_source_with(gm)
    return gm


def make_node(tracer: Any, cond_gm: fx.GraphModule, body_gm: fx.GraphModule, k: int,
              carried_args: Sequence[Any], lifted: Sequence[fx.Node]) -> fx.Node:
    attrs = [torch_cond._branch_attr(tracer, f"{name}_graph_{k}", gm)
             for name, gm in (("while_cond", cond_gm), ("while_body", body_gm))]
    return tracer.create_node("call_function", WHILE_LOOP,
                              (attrs[0], attrs[1], tuple(carried_args), tuple(lifted)), {})


def unaliased(gm: fx.GraphModule) -> fx.GraphModule:
    """A body graph none of whose outputs is one of its inputs (a carried value the
    iteration leaves as it was): backends refuse a while_loop body that aliases."""
    output = next(node for node in gm.graph.nodes if node.op == "output")
    values = list(output.args[0])
    changed = False
    for i, value in enumerate(values):
        if isinstance(value, fx.Node) and value.op == "placeholder":
            with gm.graph.inserting_before(output):
                values[i] = gm.graph.call_method("clone", (value,))
            changed = True
    if not changed:
        return gm
    output.args = (tuple(values),)
    meta = dict(gm.meta)
    gm = _module(gm.graph, type(gm).__name__, root=gm)
    gm.meta.update(meta)
    return gm


def trace_while_loop(tracer: Any, original: Callable[..., Any], fn: Any,
                     args: tuple[Any, ...]) -> Any:
    """An explicit `while_loop(cond_fn, body_fn, carried)` under `tracer`: torch's
    implementation hands `(flat_cond_fn, flat_body_fn, flat_inputs, ())` to
    torch.compile (`original(fn, args)`); here both functions are traced on fakes into
    one node, and the loop runs for real over the traced graphs."""
    cond_fn, body_fn, flat_inputs, additional = args
    flat_inputs, additional = tuple(flat_inputs), tuple(additional)
    if tracer.recording:
        try:
            return _record_while(tracer, cond_fn, body_fn, flat_inputs, additional)
        except torch_cond.CondNotCapturable as exc:
            if tracer.branch is not None:
                raise
            tracer.graph_break(exc.fallback.reason, (exc.fallback.filename, exc.fallback.lineno))
        except RecordingAborted:
            pass
    with tracer.suspended():
        return while_loop_in_python(cond_fn, body_fn, flat_inputs, additional)


def _record_while(tracer: Any, cond_fn: Callable[..., Any], body_fn: Callable[..., Any],
                  flat_inputs: tuple[Any, ...], additional: tuple[Any, ...]) -> Any:
    where = user_location()

    def refuse(reason: str) -> torch_cond.CondNotCapturable:
        return torch_cond.CondNotCapturable(Fallback(f"while_loop: {reason}", *where))

    leaves = [*flat_inputs, *additional]
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise refuse(f"a carried value is a {type(leaf).__name__}; only tensors are "
                         "captured")
    tracer.sync_global_state()
    args = [tracer.graph_arg(leaf) for leaf in leaves]
    fake_mode = tracer.fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
    spec = pytree.tree_flatten(tuple(leaves))[1]
    k = next(tracer.branch_names)
    cond_trace = torch_cond._trace_branch(tracer, "cond", cond_fn, leaves, spec, fake_mode,
                                          where, name="cond_fn of the while_loop")
    body_trace = torch_cond._trace_branch(tracer, "body", body_fn, leaves, spec, fake_mode,
                                          where, name="body_fn of the while_loop")
    if len(cond_trace.out_meta) != 1 or cond_trace.out_meta[0][0] != () or \
            cond_trace.out_meta[0][1] != torch.bool:
        raise refuse("cond_fn must return one bool tensor with no dimensions")
    with torch._C.DisableTorchFunction():
        metas = [torch_cond._tensor_meta(t) for t in flat_inputs]
    if len(body_trace.out_meta) != len(flat_inputs):
        raise refuse(f"body_fn returns {len(body_trace.out_meta)} tensors for "
                     f"{len(flat_inputs)} carried values")
    reason = changed_carry([f"carried value {i}" for i in range(len(metas))], metas,
                           body_trace.out_meta)
    if reason is not None:
        raise refuse(reason)
    if unbacked_output(body_trace.out_meta):
        raise refuse("body_fn makes an output whose shape depends on tensor values")
    lifted: dict[fx.Node, Any] = dict(cond_trace.frame.lifted_values)
    for node, value in body_trace.frame.lifted_values.items():
        lifted.setdefault(node, value)
    n = len(leaves)
    cond_gm = cond_trace.finish(n, list(lifted), class_name(f"while_cond_graph_{k}"))
    # finish() gives a tuple (cond's branches do); while_loop's cond gives the tensor
    output = next(node for node in cond_gm.graph.nodes if node.op == "output")
    output.args = (output.args[0][0],)
    entry_mode = cond_gm.meta.get("nnscaler_entry_grad_mode")
    cond_gm = _module(cond_gm.graph, f"while_cond_graph_{k}", root=cond_gm)
    cond_gm.meta["nnscaler_entry_grad_mode"] = entry_mode
    body_gm = unaliased(body_trace.finish(n, list(lifted), class_name(f"while_body_graph_{k}")))
    node = make_node(tracer, cond_gm, body_gm, k, args[:len(flat_inputs)],
                     [*args[len(flat_inputs):], *lifted])
    node.meta["nnscaler_while"] = {"line": where[1], "converted_from": "while_loop"}
    extra = (*additional, *lifted.values())
    if tracer.branch is None and tracer.symbolic is None:
        with tracer.suspended():
            flat = list(while_loop_in_python(cond_gm, body_gm, flat_inputs, extra))
            for i, value in enumerate(flat):
                if id(value) in tracer.nodes.tensor_nodes:
                    flat[i] = value.view_as(value)
    else:
        with torch._C.DisableTorchFunction(), contextlib.ExitStack() as stack:
            stack.enter_context(fake_mode)
            flat = [torch_cond._fresh_fake(meta) for meta in body_trace.out_meta]
            flat = [t.clone() if t.requires_grad else t for t in flat]
    tracer.nodes.bind_result(tuple(flat), node, dynamic=None)
    return tuple(flat)
