"""torch's training check of a shared block, asked once per block and compile.

When autograd meets `invoke_subgraph` (AOTAutograd tracing a training graph in which
block_reuse.py made repeated blocks one subgraph), torch asks for the op's schema at
every call, to refuse a subgraph that writes into an operand.  `gen_schema` answers by
tracing the whole subgraph again: about 0.09 s per call of the 12-block GPT's block,
and the joint trace meets each call twice (2.2 of the 22 s of a cold first training
step with 12 blocks; four times that with 48).  Its answer depends only on the
subgraph's code and on what the operands are (their types; a tensor's shape, strides,
dtype, device and `requires_grad`; an int's value), which the calls of one shared
block have in common.

`asked_once(gm)`, around a compile of `gm`, keeps torch's answer for each subgraph
that `gm` calls through `invoke_subgraph` and gives it again for an equal question:
the subgraph object, its code as FX prints it, and the operands' descriptions.  Any
other question (another graph's subgraph, a symbolic size, an operand we do not
describe) goes to torch as it is.  The answers are torch's own, nothing is decided
here; they are dropped when the compile ends, and torch's `gen_schema` is the
op's again when no compile of ours is in progress.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from nnscaler_eval import _C


@dataclass
class _Held:
    """A subgraph some compile in progress calls, and torch's answers about it."""

    subgraph: Any
    compiles: int = 0
    answers: dict[tuple, Any] = field(default_factory=dict)


_lock = threading.Lock()
# id(subgraph) -> what is held for it; ids stay unique while held.  Our function is
# the op's `gen_schema` exactly while this is not empty.
_held: dict[int, _Held] = {}


@contextlib.contextmanager
def asked_once(gm: Any) -> Iterator[None]:
    """Around a compile of `gm`: torch's answers kept for the subgraphs it calls."""
    subgraphs = _subgraphs_called(gm)
    if not subgraphs:
        yield
        return
    _C.call_holding(_lock, _entered, subgraphs)
    try:
        yield
    finally:
        _C.call_holding(_lock, _left, subgraphs)


def _subgraphs_called(gm: Any) -> list[Any]:
    """The GraphModules `gm`'s graph calls through invoke_subgraph."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return []
    hop = torch.ops.higher_order.invoke_subgraph
    found: dict[int, Any] = {}
    for node in graph.find_nodes(op="call_function", target=hop):
        holder = node.args[0] if node.args else None
        if isinstance(holder, torch.fx.Node) and holder.op == "get_attr":
            try:
                sub = gm.get_submodule(holder.target)
            except AttributeError:
                continue
            if isinstance(sub, torch.fx.GraphModule):
                found[id(sub)] = sub
    return list(found.values())


def _entered(subgraphs: list[Any]) -> None:
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    if not _held:
        # An attribute of the op object is found before its class's method: the op's
        # own `self.gen_schema(...)` calls come here; its class is untouched.
        invoke_subgraph.gen_schema = _gen_schema
    for sub in subgraphs:
        _held.setdefault(id(sub), _Held(sub)).compiles += 1


def _left(subgraphs: list[Any]) -> None:
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    for sub in subgraphs:
        held = _held[id(sub)]
        held.compiles -= 1
        if held.compiles == 0:
            del _held[id(sub)]   # its answers with it
    if not _held:
        vars(invoke_subgraph).pop("gen_schema", None)


def _gen_schema(subgraph: Any, identifier: Any, *operands: Any) -> Any:
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP, invoke_subgraph

    held = _held.get(id(subgraph))
    key = _question(subgraph, identifier, operands) \
        if held is not None and held.subgraph is subgraph else None
    if key is not None:
        answer = held.answers.get(key)
        if answer is not None:
            return answer
    answer = InvokeSubgraphHOP.gen_schema(invoke_subgraph, subgraph, identifier, *operands)
    if key is not None:
        held.answers[key] = answer   # dropped with `held` when the last compile ends
    return answer


def _question(subgraph: Any, identifier: Any, operands: tuple) -> Optional[tuple]:
    """What torch's answer depends on besides the subgraph object, hashable; None
    when it cannot be said."""
    if not isinstance(identifier, str):
        return None
    described = []
    for operand in operands:
        if isinstance(operand, torch.Tensor):
            shape, stride = tuple(operand.shape), operand.stride()
            if not all(type(n) is int for n in (*shape, *stride)):
                return None   # symbolic sizes: their own question each time
            described.append((type(operand), shape, stride, operand.dtype, operand.device,
                              operand.requires_grad))
        elif type(operand) in (int, bool) or operand is None:
            described.append((type(operand), operand))
        else:
            return None
    return (subgraph.code, identifier, tuple(described))
