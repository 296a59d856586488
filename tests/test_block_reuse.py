"""Block reuse (runners/block_reuse.py): the submodule calls of a capture that trace to
the same operations become one subgraph the backend graph calls per instance through
`invoke_subgraph`; a block that differs in anything its graph depends on keeps its own;
answers, gradients and buffers stay eager's; `block_reuse=False` turns it off.

The graph a backend receives is looked at by wrapping `compile_graph` (what
convert_frame hands the backend); "aot_eager" runs AOTAutograd (which traces each
invoke_subgraph identifier once) without Inductor's C++ compile.  One test compiles
with Inductor."""
from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from nnscaler_eval import convert_frame

INVOKE = torch.ops.higher_order.invoke_subgraph


class Block(nn.Module):
    def __init__(self, dim: int = 16, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim, dtype=dtype)
        self.up = nn.Linear(dim, 2 * dim, dtype=dtype)
        self.down = nn.Linear(2 * dim, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class SameCode(Block):
    """Another class whose forward is Block's code object."""


class BNBlock(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.lin(x))) * 0.5


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum(-1)


@pytest.fixture
def handed_over(monkeypatch: pytest.MonkeyPatch) -> list[torch.fx.GraphModule]:
    """Every graph convert_frame hands a backend, in order."""
    graphs: list[torch.fx.GraphModule] = []
    real = convert_frame.compile_graph

    def recording(backend_fn, gm, example_inputs):
        graphs.append(gm)
        return real(backend_fn, gm, example_inputs)

    monkeypatch.setattr(convert_frame, "compile_graph", recording)
    return graphs


def _invokes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is INVOKE]


def _run_both(model: nn.Module, x: torch.Tensor, *, train: bool, calls: int = 3,
              backend: str = "aot_eager", **options):
    """Outputs, gradients and buffers of eager and of the compiled copy over `calls`
    calls (the first is the capture's own run, for real; the later ones run what the
    backend compiled), and the compiled copy."""
    eager = copy.deepcopy(model).train(train)
    compiled = copy.deepcopy(model).train(train)
    nnscaler.compile(compiled, backend=backend, **options)
    gen = torch.Generator().manual_seed(1)
    inputs = [x] + [torch.randn(x.shape, generator=gen, dtype=x.dtype)
                    for _ in range(calls - 1)]
    results = []
    for m in (eager, compiled):
        outs, grads, bufs = [], [], []
        for value in inputs:
            if train:   # every block's input then needs a gradient, the first one's too
                value = value.detach().requires_grad_()
                out = m(value)
                out.sum().backward()
                grads += [None if p.grad is None else p.grad.clone() for p in m.parameters()]
                grads.append(value.grad)
                m.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    out = m(value)
            outs.append(out.detach())
            bufs += [b.clone() for b in m.buffers()]
        results.append((outs, grads, bufs))
    return results, compiled


def _explain(compiled: nn.Module, x: torch.Tensor, train: bool):
    """explain() under the grad mode the model ran with (grad mode is in the key)."""
    if train:
        return nnscaler.explain(compiled, x.detach().requires_grad_())
    with torch.no_grad():
        return nnscaler.explain(compiled, x)


def _assert_same(results) -> None:
    (out_e, grads_e, bufs_e), (out_c, grads_c, bufs_c) = results
    torch.testing.assert_close(out_c, out_e)
    for g_c, g_e in zip(grads_c, grads_e):
        if g_e is None:
            assert g_c is None
        else:
            torch.testing.assert_close(g_c, g_e)
    for b_c, b_e in zip(bufs_c, bufs_e):
        torch.testing.assert_close(b_c, b_e)


@pytest.mark.parametrize("train", [False, True])
def test_n_equal_blocks_share_one_subgraph(handed_over, train: bool) -> None:
    torch.manual_seed(0)
    model = Stack([Block() for _ in range(4)])
    x = torch.randn(3, 16)
    results, compiled = _run_both(model, x, train=train)
    _assert_same(results)
    gm = handed_over[-1]
    invokes = _invokes(gm)
    assert len(invokes) == 4
    assert {n.args[1] for n in invokes} == {invokes[0].args[1]}
    subgraphs = {str(n.args[0].target) for n in invokes}
    assert len(subgraphs) == 1
    # the parameters are operands: each call gets its own block's weights
    weights = [n.args[2:] for n in invokes]
    assert len({tuple(str(a.target) for a in w if a.op == "get_attr") for w in weights}) == 4
    # and the subgraph reads no attribute of its own
    sub = getattr(gm, subgraphs.pop())
    assert not [n for n in sub.graph.nodes if n.op == "get_attr"]

    report = _explain(compiled, x, train)
    (block,) = report.shared_blocks
    assert block.paths == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert block.cls == "Block"
    assert "share one subgraph: blocks.0, blocks.1, blocks.2, blocks.3" in str(report)


def _groups(model: nn.Module, x: torch.Tensor, train: bool = False) -> list[list[str]]:
    results, compiled = _run_both(model, x, train=train)
    _assert_same(results)
    return [b.paths for b in _explain(compiled, x, train).shared_blocks]


def test_a_block_of_another_shape_gets_its_own() -> None:
    torch.manual_seed(0)
    blocks = [Block(), Block(), Block(), Block()]
    blocks[2].up = nn.Linear(16, 48)
    blocks[2].down = nn.Linear(48, 16)
    assert _groups(Stack(blocks), torch.randn(3, 16)) == [["blocks.0", "blocks.1", "blocks.3"]]


def test_a_block_of_another_dtype_gets_its_own() -> None:
    torch.manual_seed(0)

    class Cast(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.blocks = nn.ModuleList(blocks)

        def forward(self, x):
            for block in self.blocks:
                x = block(x.to(block.up.weight.dtype)).to(torch.float32)
            return x.sum(-1)

    blocks = [Block(), Block(dtype=torch.float64), Block(), Block()]
    assert _groups(Cast(blocks), torch.randn(3, 16)) == [["blocks.0", "blocks.2", "blocks.3"]]


def test_a_block_with_a_hook_gets_its_own() -> None:
    torch.manual_seed(0)
    blocks = [Block() for _ in range(4)]
    blocks[1].register_forward_hook(lambda m, a, out: out * 2)
    blocks[3].up.register_forward_pre_hook(lambda m, a: (a[0] + 1,))
    # The hooked modules run opaque (their hooks on every call), so they are never
    # part of a subgraph; and a graph that calls user code is not run on fakes,
    # which block reuse needs: nothing of this graph is shared (a known limit).
    groups = _groups(Stack(blocks), torch.randn(3, 16))
    assert all(p not in g for g in groups for p in ("blocks.1", "blocks.3", "blocks.3.up"))
    assert groups == []


def test_another_class_with_the_same_code_gets_its_own() -> None:
    torch.manual_seed(0)
    assert SameCode.forward.__code__ is Block.forward.__code__
    blocks = [Block(), SameCode(), Block(), SameCode(), Block()]
    assert _groups(Stack(blocks), torch.randn(3, 16)) == [
        ["blocks.0", "blocks.2", "blocks.4"], ["blocks.1", "blocks.3"]]


def test_a_frozen_batchnorm_gets_its_own_and_buffers_update_as_eager() -> None:
    torch.manual_seed(0)
    blocks = [BNBlock() for _ in range(4)]
    blocks[2].bn.eval()   # frozen: running statistics used, not updated
    model = Stack(blocks)
    x = torch.randn(5, 16)
    # In training the other blocks update their running statistics: a subgraph that
    # writes into its inputs stays inline (_run_both compares the buffers with eager's).
    results, compiled = _run_both(model, x, train=True)
    _assert_same(results)
    compiled_blocks = compiled.blocks
    compiled_blocks[2].bn.eval()
    shared = _explain(compiled, x, True).shared_blocks
    assert all("blocks.2" not in b.paths for b in shared)
    assert all(not any(p.startswith(("blocks.0", "blocks.1", "blocks.3")) and p.endswith("bn")
                       for p in b.paths) for b in shared)
    # In eval every block reads its statistics: all four share.
    assert _groups(model, x) == [["blocks.0", "blocks.1", "blocks.2", "blocks.3"]]


def test_a_different_training_flag_gets_its_own() -> None:
    torch.manual_seed(0)

    class Flagged(Block):
        def forward(self, x):
            y = super().forward(x)
            return y * 2 if self.training else y

    blocks = [Flagged() for _ in range(4)]
    model = Stack(blocks)
    model.train()
    compiled = copy.deepcopy(model)
    compiled.blocks[1].eval()
    reference = copy.deepcopy(compiled)
    nnscaler.compile(compiled, backend="aot_eager")
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), reference(x))
    assert [b.paths for b in _explain(compiled, x, False).shared_blocks] == [
        ["blocks.0", "blocks.2", "blocks.3"]]


def test_blocks_whose_inputs_differ_share_nothing_wrong() -> None:
    """The same block fed a view of its input (another stride) or a residual reused
    later (another output set) gets its own subgraph."""
    torch.manual_seed(0)

    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))

        def forward(self, x):
            a = self.blocks[0](x)
            b = self.blocks[1](a)
            c = self.blocks[2](b.t().contiguous().t())   # same values, same strides
            d = self.blocks[3](x.t().contiguous().t().t().t())
            return (a + b + c + d).sum(-1)

    results, compiled = _run_both(Skips(), torch.randn(3, 16), train=True)
    _assert_same(results)


def test_block_reuse_false_hands_over_the_inlined_graph(handed_over) -> None:
    torch.manual_seed(0)
    results, compiled = _run_both(Stack([Block() for _ in range(3)]), torch.randn(3, 16),
                                  train=True, block_reuse=False)
    _assert_same(results)
    assert handed_over and not _invokes(handed_over[-1])
    assert _explain(compiled, torch.randn(3, 16), True).shared_blocks == []


def test_eager_backend_and_unknown_backends_get_no_subgraphs(handed_over) -> None:
    torch.manual_seed(0)
    model = Stack([Block() for _ in range(3)])
    nnscaler.compile(model)   # eager: the generated runner, no backend graph
    x = torch.randn(3, 16)
    torch.testing.assert_close(model(x), Stack.forward(model, x))
    assert nnscaler.explain(model, x).shared_blocks == []

    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm

    other = Stack([Block() for _ in range(3)])
    nnscaler.compile(other, backend=backend)
    other(x)
    assert seen and not _invokes(seen[-1])


def test_block_reuse_option_is_checked() -> None:
    with pytest.raises(TypeError, match="block_reuse must be a bool"):
        nnscaler.compile(nn.Linear(2, 2), backend="aot_eager", block_reuse="yes")


def test_getitem_outputs_and_multiple_outputs() -> None:
    """A block returning two tensors: the subgraph's outputs are read by index."""
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x, h):
            y = torch.tanh(self.a(x) + self.b(h))
            return y * 2, torch.sigmoid(y) + h

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.cells = nn.ModuleList(Two() for _ in range(3))

        def forward(self, x):
            h = x * 0   # needs a gradient as every later h does: all three calls equal
            for cell in self.cells:
                x, h = cell(x, h)
            return x + h

    x = torch.randn(4, 8)
    assert _groups(Chain(), x, train=True) == [["cells.0", "cells.1", "cells.2"]]
    assert operator.getitem   # the outer graph reads the tuple by index


def test_inductor_compiles_the_shared_block(handed_over) -> None:
    """One Inductor compile (small): answers and gradients close to eager's, with the
    block shared."""
    torch.manual_seed(0)
    model = Stack([Block(8) for _ in range(3)])
    eager = copy.deepcopy(model)
    nnscaler.compile(model, backend="inductor")
    x = torch.randn(2, 8, requires_grad=True)   # every block's input needs a gradient
    out = model(x)
    out.sum().backward()
    ref = eager(x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert len(_invokes(handed_over[-1])) == 3


@pytest.mark.parametrize("train", [False, True])
def test_later_calls_of_a_block_get_the_example_values_its_op_would_give(
        handed_over, monkeypatch, train):
    """The fake run that annotates a shared graph for the caches (backend_form.py) runs
    a block's higher-order op on its first call only; each later call with operands of
    equal metadata gets fresh fakes with its results' metadata.  They equal what
    running the op for every call gives (the caches key on them)."""
    from torch._subclasses.fake_tensor import extract_tensor_metadata

    from nnscaler_eval.runners import backend_form

    def annotations() -> list:
        model = Stack([Block() for _ in range(4)])
        x = torch.randn(3, 16, requires_grad=train)
        _run_both(model, x, train=train)
        gm = handed_over[-1]
        invokes = _invokes(gm)
        assert len(invokes) == 4
        return [[extract_tensor_metadata(t) for t in node.meta["example_value"]]
                for node in invokes]

    copied = []
    real_copy = backend_form._same_metadata
    monkeypatch.setattr(backend_form, "_same_metadata",
                        lambda t: copied.append(t) or real_copy(t))
    reused = annotations()
    assert copied          # later calls took the first one's metadata
    monkeypatch.setattr(backend_form, "_block_call_key", lambda node, env: None)
    assert annotations() == reused
    assert all(meta == reused[0] for meta in reused)


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "fake run"])
def test_block_keys_come_from_the_captures_run_without_a_second_fake_run(
        handed_over, monkeypatch, recorded):
    """The keys compare each call's inputs' and outputs' metadata as the capture's run
    recorded them (capture/nodes.py): the plain graph is not run again on fakes, only
    the shared one is (for the caches).  Without recorded metadata the plain graph is
    run on fakes, and the same blocks are shared."""
    from nnscaler_eval.runners import backend_form, block_reuse

    if not recorded:
        monkeypatch.setattr(block_reuse, "_recorded_metas", lambda *args: None)
    runs = []
    real = backend_form.annotate_example_values
    monkeypatch.setattr(backend_form, "annotate_example_values",
                        lambda gm, *args: runs.append(gm) or real(gm, *args))
    model = Stack([Block() for _ in range(3)])
    results, compiled = _run_both(model, torch.randn(3, 16), train=True)
    _assert_same(results)
    assert len(_invokes(handed_over[-1])) == 3
    assert len(runs) == (1 if recorded else 2)
    assert runs[-1] is handed_over[-1]


# -- torch's training check of a shared block, asked once (runners/subgraph_schemas.py) --


@pytest.fixture
def schemas_asked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The identifier of every question torch's own invoke_subgraph.gen_schema answers."""
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    asked: list[str] = []
    real = InvokeSubgraphHOP.gen_schema

    def counting(self, subgraph, identifier, *operands):
        asked.append(identifier)
        return real(self, subgraph, identifier, *operands)

    monkeypatch.setattr(InvokeSubgraphHOP, "gen_schema", counting)
    return asked


@pytest.mark.parametrize("n", [2, 5])
def test_the_training_check_of_a_shared_block_is_asked_once(schemas_asked, n: int) -> None:
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    torch.manual_seed(0)
    results, compiled = _run_both(Stack([Block() for _ in range(n)]), torch.randn(3, 16),
                                  train=True)
    _assert_same(results)
    # Autograd asks at every call, twice per call in the joint trace (2n + 1 questions
    # before); now once per kind of operand (fake, then functional tensors).
    asked = [i for i in schemas_asked if i.startswith("nnscaler_block_")]
    assert 1 <= len(asked) <= 2 and len(set(asked)) == 1, asked
    assert "gen_schema" not in vars(invoke_subgraph)   # torch's own again
    assert len(_explain(compiled, torch.randn(3, 16), True).shared_blocks) == 1


def _writing_sub() -> torch.fx.GraphModule:
    class Writes(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
            a.add_(1)
            return (a * b,)

    return torch.fx.symbolic_trace(Writes())


def _calling(sub: torch.fx.GraphModule) -> torch.fx.GraphModule:
    root = nn.Module()
    root.sub = sub
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    out = graph.call_function(INVOKE, (graph.get_attr("sub"), "writes", a, b))
    graph.output(out)
    return torch.fx.GraphModule(root, graph)


def test_a_remembered_answer_still_refuses_a_subgraph_that_writes(schemas_asked) -> None:
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    from nnscaler_eval.runners import subgraph_schemas

    sub = _writing_sub()
    b = torch.randn(3, requires_grad=True)
    with subgraph_schemas.asked_once(_calling(sub)):
        for _ in range(3):
            with pytest.raises(RuntimeError, match="in-place input or buffer mutations"):
                invoke_subgraph(sub, "writes", torch.randn(3), b)
        # Another question (other sizes) is torch's to answer; so is any subgraph the
        # compiled graph does not call.
        with pytest.raises(RuntimeError, match="in-place input or buffer mutations"):
            invoke_subgraph(sub, "writes", torch.randn(4), torch.randn(4, requires_grad=True))
        other = _writing_sub()
        for _ in range(2):
            with pytest.raises(RuntimeError, match="in-place input or buffer mutations"):
                invoke_subgraph(other, "writes", torch.randn(3), b)
    assert schemas_asked == ["writes"] * 4
    assert "gen_schema" not in vars(invoke_subgraph)
    # Outside any compile of ours, torch is asked every time.
    with pytest.raises(RuntimeError, match="in-place input or buffer mutations"):
        invoke_subgraph(sub, "writes", torch.randn(3), b)
    assert len(schemas_asked) == 5


def test_nested_compiles_keep_answers_until_the_last_ends(schemas_asked) -> None:
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    from nnscaler_eval.runners import subgraph_schemas

    sub = _writing_sub()
    gm = _calling(sub)
    b = torch.randn(3, requires_grad=True)

    def ask() -> None:
        with pytest.raises(RuntimeError, match="in-place"):
            invoke_subgraph(sub, "writes", torch.randn(3), b)

    with subgraph_schemas.asked_once(gm):
        with subgraph_schemas.asked_once(gm):
            ask()
        ask()   # the outer compile still holds the answer
        assert "gen_schema" in vars(invoke_subgraph)
    assert schemas_asked == ["writes"]
    assert "gen_schema" not in vars(invoke_subgraph) and not subgraph_schemas._held


# -- what makes two calls differ besides their nodes and inputs ------------------------


class Scaled(Block):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return torch.atan2(y * self.scale, -torch.ones_like(y))


def test_a_constant_of_another_sign_gets_its_own() -> None:
    """0.0 == -0.0, but atan2(0.0, -1) is pi and atan2(-0.0, -1) is -pi: constants are
    compared by their bits."""
    torch.manual_seed(0)
    model = Stack([Scaled(0.0), Scaled(-0.0), Scaled(0.0), Scaled(-0.0)])
    assert _groups(model, torch.randn(3, 16)) == [["blocks.0", "blocks.2"],
                                                  ["blocks.1", "blocks.3"]]


class SomeUnderAutocast(nn.Module):
    """Blocks 1 and 3 run under autocast to bfloat16, block 2 with it switched off."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = self.blocks[1](x)
            with torch.autocast("cpu", enabled=False):
                x = self.blocks[2](x.float())
            x = self.blocks[3](x)
        return self.blocks[4](x.float()).sum(-1)


@pytest.mark.parametrize("train", [False, True])
def test_blocks_under_another_autocast_state_get_their_own(train: bool) -> None:
    torch.manual_seed(0)
    groups = _groups(SomeUnderAutocast(), torch.randn(3, 16), train=train)
    assert ["blocks.1", "blocks.3"] in groups
    assert not any({"blocks.0", "blocks.1"} <= set(g) or {"blocks.2", "blocks.3"} <= set(g)
                   for g in groups)


def test_an_input_changed_in_place_after_it_was_recorded_is_not_shared() -> None:
    """`v = base[:2]` does not require grad when taken; `base.mul_(w)` makes it (and
    base) require grad.  The block fed `v` must not share a subgraph traced for an
    input that needs no gradient, or no gradient reaches `pre.weight`."""
    torch.manual_seed(0)

    class Viewed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(16, 16)
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            base = x * 1.0
            v = base[:2]
            other = (x * 2.0)[:2]
            base.mul_(self.pre.weight.sum())
            return (self.blocks[0](v) + self.blocks[1](other)).sum(-1)

    model = Viewed()
    eager, compiled = copy.deepcopy(model), copy.deepcopy(model)
    nnscaler.compile(compiled, backend="aot_eager")
    for _ in range(3):
        x = torch.randn(4, 16)
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
        assert compiled.pre.weight.grad is not None
        torch.testing.assert_close(compiled.pre.weight.grad, eager.pre.weight.grad)


def test_inductor_training_with_layers_between_shared_blocks() -> None:
    """A Linear between equal blocks: Inductor's buffer reuse in the calling graph
    overwrote a block's input that the partitioned forward saves for the backward
    (block_reuse.compile_settings turns it off for graphs with a shared block):
    gradients from the second call on must be eager's."""
    torch.manual_seed(0)

    class Between(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.mids = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.blocks[0](x)
            for mid, block in zip(self.mids, self.blocks[1:]):
                x = block(mid(x))
            return x.pow(2).sum(-1)

    results, compiled = _run_both(Between(), torch.randn(4, 16), train=True,
                                  backend="inductor")
    _assert_same(results)
    assert [b.paths for b in _explain(compiled, torch.randn(4, 16), True).shared_blocks] == [
        ["blocks.0", "blocks.1", "blocks.2"]]


def test_an_interrupted_compile_leaves_torchs_op_as_it_was(schemas_asked) -> None:
    """Ctrl-C in the middle of a compile: torch's gen_schema is the op's again, nothing
    is held, and the next compile keeps answers again."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    from nnscaler_eval.runners import subgraph_schemas

    sub = _writing_sub()
    gm = _calling(sub)
    b = torch.randn(3, requires_grad=True)
    with pytest.raises(KeyboardInterrupt):
        with subgraph_schemas.asked_once(gm):
            with pytest.raises(RuntimeError, match="in-place"):
                invoke_subgraph(sub, "writes", torch.randn(3), b)
            raise KeyboardInterrupt
    assert "gen_schema" not in vars(invoke_subgraph)
    assert not subgraph_schemas._held
    with subgraph_schemas.asked_once(gm):
        for _ in range(2):
            with pytest.raises(RuntimeError, match="in-place"):
                invoke_subgraph(sub, "writes", torch.randn(3), b)
    assert schemas_asked == ["writes", "writes"]
