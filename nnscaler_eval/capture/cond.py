"""`torch.cond` under the tracer: both branches in one graph, without running either
(see `trace_cond` for how, and why that is safe).

Each branch is recorded into a graph of its own (a `BranchFrame`) on fake tensors; a
value of an enclosing graph that it reads becomes an input of the branch (`lift`), and
every op of it runs on fakes (`fakeify`, `call_in_branch`). trace_patches routes
`torch.cond` to the tracer, which hands it to `trace_cond` here. These functions drive
the tracer through its recording interface: `graph`, `branch`, `fake_mode`,
`global_state`, `nodes`, `branch_names` (what a branch swaps or reads), and
`recording`, `graph_arg`, `create_node`, `sync_global_state`, `suspended`,
`graph_break`.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from nnscaler_eval import _C
from nnscaler_eval.capture import unwinding
from nnscaler_eval.capture.calls import qualname, tensors_in
from nnscaler_eval.tracing.locations import user_location
from nnscaler_eval.capture.nodes import class_name, identifier
from nnscaler_eval.capture.results import Fallback, GraphBreakError, RecordingAborted
from nnscaler_eval.runners.codegen import InputPath
from nnscaler_eval.runners.fx_source import release_source_with
from nnscaler_eval.tracing.tracked_values import TrainingFlag, plain_value, quiet_plain


class CondNotCapturable(Exception):
    """Internal: a torch.cond branch cannot be captured; carries the reason and line."""

    def __init__(self, fallback: Fallback) -> None:
        super().__init__(str(fallback))
        self.fallback = fallback


class BranchFrame:
    """The graph of one torch.cond branch while it is traced.

    Its placeholders are the operands (`inputs`) and the values of the enclosing graph
    it reads (`lifted`: enclosing node -> placeholder; `lifted_values`: that node's
    value in the run, used for the real run of the taken branch).
    """

    def __init__(self, graph: fx.Graph, parent_graph: fx.Graph, parent: Optional[BranchFrame]):
        self.graph = graph
        self.parent_graph = parent_graph
        self.parent = parent
        self.inputs: list[fx.Node] = []
        self.lifted: dict[fx.Node, fx.Node] = {}
        self.lifted_values: dict[fx.Node, Any] = {}
        self.attrs: dict[str, Any] = {}  # get_attr targets of this graph (nested branches)

    def add_input(self, name: str) -> fx.Node:
        node = self.graph.placeholder(identifier(name))
        self.inputs.append(node)
        return node

    def lift(self, outer: fx.Node, value: Any) -> fx.Node:
        placeholder = self.lifted.get(outer)
        if placeholder is None:
            # Placeholder order does not matter yet: `BranchTrace.finish` rebuilds it.
            placeholder = self.graph.placeholder(identifier(outer.name))
            self.lifted[outer] = placeholder
            self.lifted_values[outer] = value
        return placeholder


@dataclass
class BranchTrace:
    frame: BranchFrame
    out_spec: pytree.TreeSpec
    out_meta: list[tuple[Any, ...]]
    entry_grad_mode: bool
    # With `constants=True` (an `if` converted from bytecode, capture/branches.py): the
    # non-tensor leaves of the output by leaf position, and which leaves are tensors
    # (the graph outputs, in order).
    constants: dict[int, Any] = field(default_factory=dict)
    tensor_leaves: list[int] = field(default_factory=list)

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
            new = graph.placeholder(old.name if old is not None else identifier(outer.name))
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


def trace_cond(
    tracer: Any,
    original: Callable[..., Any],
    pred: Any,
    true_fn: Callable[..., Any],
    false_fn: Callable[..., Any],
    operands: Any,
) -> Any:
    """`torch.cond` under `tracer` (trace_patches routes it there, and it here).

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
    tracked_pred = isinstance(pred, TrainingFlag) and pred.tracer is tracer
    # A predicate on a symbolic size (a dynamic capture): one node too, its
    # predicate computed from the inputs' sizes on every hit, as torch.export has it.
    symbolic_pred = isinstance(pred, torch.SymBool) and tracer.symbolic is not None
    if tracer.recording and not (isinstance(pred, torch.Tensor) or tracked_pred
                                 or symbolic_pred):
        return true_fn(*operands) if plain_value(pred) else false_fn(*operands)
    if tracer.recording:
        try:
            return _record_cond(tracer, pred, true_fn, false_fn, operands)
        except CondNotCapturable as exc:
            if tracer.branch is not None:
                raise  # the enclosing branch is not capturable either
            tracer.graph_break(exc.fallback.reason, (exc.fallback.filename, exc.fallback.lineno))
        except RecordingAborted:
            pass  # graph_break already recorded why
    stack = torch.overrides._get_current_function_mode_stack()
    if stack and stack[-1] is tracer:
        with torch.overrides._pop_mode_temporarily():
            return original(pred, true_fn, false_fn, operands)
    return original(pred, true_fn, false_fn, operands)


def _record_cond(
    tracer: Any,
    pred: Any,
    true_fn: Callable[..., Any],
    false_fn: Callable[..., Any],
    operands: Any,
) -> Any:
    where = user_location()

    def refuse(reason: str) -> CondNotCapturable:
        return CondNotCapturable(Fallback(f"torch.cond: {reason}", *where))

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
    tracer.sync_global_state()  # branches start from the run's grad / autocast state
    pred_arg = tracer.graph_arg(pred)
    operand_args = [tracer.graph_arg(leaf) for leaf in leaves]

    fake_mode = tracer.fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
    k = next(tracer.branch_names)  # outer branches get the lower numbers
    true_trace = _trace_branch(tracer, "true", true_fn, leaves, in_spec, fake_mode, where)
    false_trace = _trace_branch(tracer, "false", false_fn, leaves, in_spec, fake_mode, where)
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
        trace.finish(len(leaves), list(lifted), class_name(f"{name}_graph_{k}"))
        for trace, name in ((true_trace, "true"), (false_trace, "false"))
    ]
    attrs = [
        _branch_attr(tracer, f"{name}_graph_{k}", gm)
        for name, gm in zip(("true", "false"), modules)
    ]
    node = tracer.create_node(
        "call_function",
        torch.ops.higher_order.cond,
        (pred_arg, attrs[0], attrs[1], (*operand_args, *lifted)),
        {},
    )

    if tracer.branch is None and tracer.symbolic is None:
        # The real run: the taken branch's graph on the real values, once.
        if isinstance(pred, torch.Tensor):
            with torch._C.DisableTorchFunction():
                taken = bool(pred)
        else:
            taken = quiet_plain(pred)
        with tracer.suspended():
            flat = list(modules[0 if taken else 1](*leaves, *lifted.values()))
            for i, value in enumerate(flat):
                if id(value) in tracer.nodes.tensor_nodes:  # an input passed through
                    flat[i] = value.view_as(value)
    else:
        # Nested in a branch being traced, or a dynamic capture (nothing runs for
        # real, and choosing a branch would specialise its predicate): stand-ins with
        # the outputs' metadata.
        with torch._C.DisableTorchFunction(), contextlib.ExitStack() as stack:
            stack.enter_context(fake_mode)
            flat = [_fresh_fake(meta) for meta in true_trace.out_meta]
            # Results of an op, not leaves (a leaf that requires grad refuses in-place ops).
            flat = [t.clone() if t.requires_grad else t for t in flat]
    tracer.nodes.bind_result(tuple(flat), node, dynamic=None)
    return pytree.tree_unflatten(flat, true_trace.out_spec)


def _trace_branch(
    tracer: Any,
    which: str,
    fn: Callable[..., Any],
    leaves: list[torch.Tensor],
    in_spec: pytree.TreeSpec,
    fake_mode: FakeTensorMode,
    where: tuple[str, int],
    constants: bool = False,
    name: Optional[str] = None,
) -> BranchTrace:
    """Record `fn(*operands)` into a graph of its own, on fake operands.

    `constants`: a non-tensor leaf of the output is kept as a constant of the branch
    (BranchTrace.constants) instead of refused."""
    frame = BranchFrame(fx.Graph(), tracer.graph, tracer.branch)
    saved = (tracer.graph, tracer.branch, tracer.fake_mode, tracer.global_state)
    entry_grad_mode = tracer.global_state.graph_grad_mode
    tracer.graph, tracer.branch, tracer.fake_mode = frame.graph, frame, fake_mode
    tracer.global_state = tracer.global_state.for_branch()
    flat_operands = in_spec == pytree.tree_flatten(tuple(leaves))[1]
    names = _parameter_names(fn, len(leaves)) if flat_operands else None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_no_saved_tensor_hooks())
            if saved[2] is None:
                stack.enter_context(fake_mode)
            with torch._C.DisableTorchFunction():
                fakes = [_fresh_fake(_tensor_meta(leaf)) for leaf in leaves]
            for i, fake in enumerate(fakes):
                tracer.nodes.map(fake, frame.add_input(names[i] if names else f"arg{i}"))
            out = fn(*pytree.tree_unflatten(fakes, in_spec))
            all_leaves, out_spec = pytree.tree_flatten(out)
            kept: dict[int, Any] = {}
            tensor_leaves: list[int] = []
            for i, leaf in enumerate(all_leaves):
                if isinstance(leaf, torch.Tensor):
                    tensor_leaves.append(i)
                elif constants:
                    kept[i] = leaf
                else:
                    tracer.graph_break(
                        f"the branch returns a {type(leaf).__name__}; "
                        "only tensors are captured"
                    )
            out_leaves = [all_leaves[i] for i in tensor_leaves]
            out_nodes = [tracer.graph_arg(leaf) for leaf in out_leaves]
            tracer.sync_global_state()
            if tracer.global_state.open_autocast:
                tracer.graph_break("the branch leaves autocast changed")
            with torch._C.DisableTorchFunction():
                out_meta = [_tensor_meta(leaf) for leaf in out_leaves]
        frame.graph.output(tuple(out_nodes))
    except (CondNotCapturable, GraphBreakError):
        raise
    except RecordingAborted:
        raise CondNotCapturable(
            Fallback(f"torch.cond: the {which} branch could not be recorded", *where)
        ) from None
    except Exception as exc:  # the branch cannot run on fake tensors
        if unwinding.interrupt_in(exc) is not None:
            raise
        import os
        import traceback
        if os.environ.get("NNS_DEBUG_COND"):
            t = traceback.format_exception(exc)
            print("".join(t[:40]), "...", "".join(t[-20:]))
        name = name or getattr(fn, "__qualname__", None) or repr(fn)
        raise CondNotCapturable(
            Fallback(
                f"torch.cond: the {which} branch {name} cannot be traced "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                *where,
            )
        ) from exc
    finally:
        tracer.graph, tracer.branch, tracer.fake_mode, tracer.global_state = saved
    return BranchTrace(frame, out_spec, out_meta, entry_grad_mode, kept, tensor_leaves)


@contextlib.contextmanager
def _no_saved_tensor_hooks() -> Any:
    """A branch is traced on fake tensors: the saved-tensor hooks of the run around it
    (activation checkpointing counts what the forward saves, and compares the count
    when it recomputes) must not see what the trace saves.  They are taken off the
    stack for the trace and put back after, in order."""
    autograd = torch._C._autograd
    hooks = []
    while True:
        top = autograd._top_saved_tensors_default_hooks(True)
        if top is None:
            break
        hooks.append(top)
        autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(hooks):
            autograd._push_saved_tensors_default_hooks(pack, unpack)


def _branch_attr(tracer: Any, name: str, gm: fx.GraphModule) -> fx.Node:
    """A get_attr node for a branch GraphModule, in the graph being recorded."""
    if tracer.branch is None:
        while name in tracer.nodes.attr_values:
            name += "_"
        return tracer.nodes.get_attr(name, gm)
    tracer.branch.attrs[name] = gm
    return tracer.graph.get_attr(name)


def lift(branch: Optional[BranchFrame], node: fx.Node, value: Any,
         root_graph: fx.Graph) -> Optional[fx.Node]:
    """`node`, of an enclosing graph, as a value of the innermost branch `branch`: an
    input of each branch in between (lifted, level by level). None when `node` is of
    no enclosing graph: a value of a branch used outside it."""
    chain = []
    frame = branch
    while frame is not None and frame.graph is not node.graph:
        chain.append(frame)
        frame = frame.parent
    if frame is None and node.graph is not root_graph:
        return None
    for frame in reversed(chain):
        node = frame.lift(node, value)
    return node


def fakeify(value: Any, fake_mode: Optional[FakeTensorMode]) -> Any:
    """Inside a cond branch (`fake_mode` set), real tensors as fakes: no op of a branch
    touches real data (FakeTensorMode would otherwise run in-place ops on real inputs)."""
    if fake_mode is None:
        return value
    if isinstance(value, torch.Tensor):
        if isinstance(value, FakeTensor):
            return value
        return fake_mode.from_tensor(value)
    if isinstance(value, (tuple, list)):
        items = [fakeify(v, fake_mode) for v in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return {k: fakeify(v, fake_mode) for k, v in value.items()}
    return value


def call_in_branch(tracer: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run one op of a cond branch on fakes, refusing mutation of its inputs."""
    call_args = fakeify(quiet_plain(args), tracer.fake_mode)
    call_kwargs = fakeify(quiet_plain(kwargs), tracer.fake_mode)
    inputs = list(tensors_in((call_args, call_kwargs)))
    with torch._C.DisableTorchFunction():
        versions = [t._version for t in inputs]
    result = func(*call_args, **call_kwargs)
    with torch._C.DisableTorchFunction():
        changed = [t for t, v in zip(inputs, versions) if t._version != v]
    for tensor in changed:
        node = tracer.nodes.tensor_nodes.get(id(tensor))
        if node is None or node.graph is not tracer.graph or node.op == "placeholder":
            tracer.graph_break(
                f"{qualname(func)} mutates an input or closure of the branch "
                "(torch.cond branches must not)"
            )
    return result
