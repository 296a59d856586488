"""`torch.cond` captured as one `torch.ops.higher_order.cond` node.

A tensor (or `self.training`) predicate needs no fallback and no recapture when its
value changes: both branches are subgraphs, traced on fake tensors; the runner picks
one per call. Branches that torch.cond itself refuses (mutation, Python side effects,
data-dependent Python control flow) are refused with the branch's line.
"""

from __future__ import annotations

import linecache
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import nnscaler
from nnscaler_eval.capture import GraphBreakError

from test_tracer import replay, trace

COND = torch.ops.higher_order.cond
TOL = dict(rtol=1e-6, atol=1e-6)


def true_fn(x: torch.Tensor) -> torch.Tensor:
    return x.cos() + x.sin()


def false_fn(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


class DataDependentCondPredicate(nn.Module):
    """The seed's model: a data-dependent predicate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 4.0, true_fn, false_fn, (x,))


def reference(x: torch.Tensor) -> torch.Tensor:
    return true_fn(x) if x.sum() > 4.0 else false_fn(x)


class Branchy(nn.Module):
    """Branches that call submodules (Linear, Dropout) and read closures."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.scale = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.lin(x)

        def positive(a):
            return self.drop(a) * self.scale + h

        def negative(a):
            return a.relu() - h

        return torch.cond(h.sum() > 0, positive, negative, (x,)) * 2


def branchy_reference(model: Branchy, x):
    h = model.lin(x)
    out = model.drop(x) * model.scale + h if h.sum() > 0 else x.relu() - h
    return out * 2


def inputs_of_both_signs(shape=(4, 8)):
    return [sign * (torch.rand(*shape) + 1.0) for sign in (1.0, -1.0, 1.0, -1.0)]


def line_of(marker: str) -> int:
    with open(__file__) as source:
        for number, line in enumerate(source, start=1):
            if line.rstrip().endswith(f"# <{marker}>"):
                return number
    raise AssertionError(marker)


def cond_nodes(gm: torch.fx.GraphModule):
    return [n for n in gm.graph.nodes if n.target is COND]


# ---------------------------------------------------------------------------
# Under nnscaler.compile


def test_seed_model_one_capture_across_predicate_changes():
    model = nnscaler.compile(DataDependentCondPredicate())
    for x in inputs_of_both_signs((3, 3)):
        torch.testing.assert_close(model(x), reference(x), **TOL)
    info = nnscaler.cache_info(model)
    assert info.captures == 1 and info.fallbacks == 0 and info.hits == 3


def test_first_torch_cond_of_a_process_is_captured_once():
    # torch.cond's first use imports numpy.random (torch imports numpy only): a
    # generator appearing mid-capture once read as "the forward drew random numbers"
    # and sent the model to eager for good. In a fresh interpreter, where nothing has
    # imported it yet.
    code = textwrap.dedent("""
        import sys
        import torch, nnscaler
        assert "numpy.random" not in sys.modules
        from test_cond import DataDependentCondPredicate, inputs_of_both_signs, reference
        model = nnscaler.compile(DataDependentCondPredicate())
        for x in inputs_of_both_signs((3, 3)):
            torch.testing.assert_close(model(x), reference(x), rtol=1e-6, atol=1e-6)
        print(tuple(nnscaler.cache_info(model)))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr[-3000:]
    captures, hits, misses, fallbacks, entries = eval(done.stdout.strip().splitlines()[-1])
    assert (captures, hits, fallbacks) == (1, 3, 0), done.stdout


def test_seed_model_matches_eager_torch_cond():
    x_pos, x_neg = torch.full((3, 3), 1.0), torch.full((3, 3), -1.0)
    eager = DataDependentCondPredicate()
    expected = [eager(x_pos), eager(x_neg)]  # eager torch.cond (compiles its branches)
    model = nnscaler.compile(DataDependentCondPredicate())
    torch.testing.assert_close(model(x_pos), expected[0], **TOL)
    torch.testing.assert_close(model(x_neg), expected[1], **TOL)
    assert nnscaler.cache_info(model).captures == 1


def test_branches_calling_submodules_outputs_and_gradients_equal_eager():
    eager = Branchy()
    model = Branchy()
    model.load_state_dict(eager.state_dict())
    nnscaler.compile(model)
    for i, x in enumerate(inputs_of_both_signs() * 2):
        if i == 4:  # train -> eval: the dropout flag is an input, no recapture
            eager.eval()
            model.eval()
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(i)
        out = model(x1)
        torch.manual_seed(i)
        ref = branchy_reference(eager, x2)
        torch.testing.assert_close(out, ref, **TOL)
        out.square().sum().backward()
        ref.square().sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad, **TOL)
        for (name, a), b in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, **TOL, msg=name)
        model.zero_grad()
        eager.zero_grad()
    assert nnscaler.cache_info(model).captures == 1


def test_explain_shows_the_cond_node_and_its_branches():
    model = nnscaler.compile(Branchy())
    report = nnscaler.explain(model, torch.rand(4, 8))
    text = str(report)
    assert report.fallbacks == [] and len(report.graphs) == 1
    assert "torch.ops.higher_order.cond(" in text
    gm = report.graphs[0]
    (node,) = cond_nodes(gm)
    true_gm, false_gm = (getattr(gm, a.target) for a in node.args[1:3])
    assert isinstance(true_gm, torch.fx.GraphModule)
    assert "_nn.linear(" not in true_gm.code  # the Linear runs before the cond, h is lifted
    assert "dropout" in true_gm.code and "relu" in false_gm.code
    # Closures became explicit inputs: x, then the scale parameter, h and the flag.
    assert len(node.args[3]) == len([n for n in true_gm.graph.nodes if n.op == "placeholder"])


def test_nested_cond():
    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x):
            def outer_true(a):
                inner = torch.cond(a.mean() > 2.0, lambda b: b * self.w, lambda b: b - self.w, (a,))
                return inner + 1

            return torch.cond(x.sum() > 0, outer_true, lambda a: a.exp(), (x,))

    def ref(m, x):
        if x.sum() > 0:
            return (x * m.w if x.mean() > 2.0 else x - m.w) + 1
        return x.exp()

    eager = Nested()
    model = Nested()
    model.load_state_dict(eager.state_dict())
    nnscaler.compile(model)
    for x in (torch.full((2, 3), 3.0), torch.full((2, 3), 1.0), -torch.rand(2, 3)):
        torch.testing.assert_close(model(x), ref(eager, x), **TOL)
    assert nnscaler.cache_info(model).captures == 1
    gm = nnscaler.explain(model, torch.rand(2, 3)).graphs[0]
    (node,) = cond_nodes(gm)
    outer_true = getattr(gm, node.args[1].target)
    assert len(cond_nodes(outer_true)) == 1  # nested graph modules, as torch.export has


def test_training_flag_predicate_is_a_graph_input():
    class ByMode(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.cond(self.training, lambda a: self.lin(a), lambda a: a * 2, (x,))

    eager, model = ByMode(), ByMode()
    model.load_state_dict(eager.state_dict())
    nnscaler.compile(model)
    x = torch.randn(2, 4)
    for mode in ("train", "eval", "train", "eval"):
        getattr(eager, mode)()
        getattr(model, mode)()
        torch.testing.assert_close(model(x), eager.lin(x) if eager.training else x * 2, **TOL)
    assert nnscaler.cache_info(model).captures == 1


def test_python_predicate_is_still_inlined():
    class Shape(nn.Module):
        def forward(self, x):
            return torch.cond(x.shape[0] > 4, lambda a: a.cos(), lambda a: a.sin(), (x,))

    cap = trace(Shape(), torch.randn(3))
    assert cap.fallback is None and cond_nodes(cap.graph_module) == []
    assert "sin" in cap.graph_module.code and "cos" not in cap.graph_module.code


def test_runner_is_a_plain_python_conditional():
    model = DataDependentCondPredicate()
    cap = trace(model, torch.randn(3, 3))
    source = cap.runner_source()
    assert " if " in source and "higher_order" not in source
    runner = cap.make_runner()
    true_branch = runner.__globals__["true_graph_0"]
    branch_source = "".join(linecache.getlines(true_branch.__code__.co_filename))
    assert "x.cos()" in branch_source and "x.sin()" in branch_source
    for x in inputs_of_both_signs((3, 3)):
        torch.testing.assert_close(replay(cap, model, x), reference(x), **TOL)


def test_trace_runs_the_taken_branch_once_and_the_other_not_at_all():
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("hits", torch.zeros(()))

        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda a: a + self.hits, lambda a: a - self.hits, (x,))

    model = Counting()
    x = torch.ones(3)
    cap = trace(model, x)
    assert cap.fallback is None
    torch.testing.assert_close(cap.result, x)
    assert model.hits.item() == 0


# ---------------------------------------------------------------------------
# Branches torch.cond forbids: refused with the branch's line, nothing leaks


class MutatesClosure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        def untaken(a):
            self.b.add_(1)  # <mutation>
            return a - 1

        return torch.cond(x.sum() > 0, lambda a: a + 1, untaken, (x,))


class MutatesOperand(nn.Module):
    def forward(self, x):
        def branch(a):
            a.mul_(2)  # <operand mutation>
            return a

        return torch.cond(x.sum() > 0, branch, lambda a: a - 1, (x,))


class PrintsInUntaken(nn.Module):
    def forward(self, x):
        def untaken(a):
            print("never printed")  # <print>
            return a - 1

        return torch.cond(x.sum() > 0, lambda a: a + 1, untaken, (x,))


class BranchesOnData(nn.Module):
    def forward(self, x):
        def branch(a):
            if a.sum() > 2:  # <data branch>
                return a + 1
            return a

        return torch.cond(x.sum() > 0, branch, lambda a: a - 1, (x,))


class HookedSubmodule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.lin.register_forward_hook(lambda *args: None)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda a: self.lin(a), lambda a: a * 2, (x,))  # <hooked>


@pytest.mark.parametrize(
    "cls, marker, words",
    [
        (MutatesClosure, "mutation", "mutates an input or closure"),
        (MutatesOperand, "operand mutation", "mutates an input or closure"),
        (PrintsInUntaken, "print", "print()"),
        (BranchesOnData, "data branch", "data-dependent control flow"),
        (HookedSubmodule, "hooked", "hooks"),
    ],
)
def test_uncapturable_branch_is_refused_with_its_line(cls, marker, words, capsys):
    model = cls()
    with pytest.raises(GraphBreakError) as info:
        trace(model, torch.ones(3), fullgraph=True)
    fallback = info.value.fallback
    assert "torch.cond branch" in fallback.reason and words in fallback.reason
    assert fallback.lineno == line_of(marker)
    assert "never printed" not in capsys.readouterr().out
    if isinstance(model, MutatesClosure):
        assert model.b.sum().item() == 0  # the untaken branch touched no real data


def test_branches_with_different_output_shapes_are_refused():
    class Shapes(nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda a: a[0], lambda a: a, (x,))

    with pytest.raises(GraphBreakError, match="differs between the branches"):
        trace(Shapes(), torch.ones(2, 3), fullgraph=True)


def test_a_tensor_leaking_out_of_a_branch_is_an_error():
    class Leaks(nn.Module):
        def forward(self, x):
            box = []

            def branch(a):
                box.append(a + 1)
                return a * 2

            out = torch.cond(x.sum() > 0, branch, lambda a: a - 1, (x,))
            return out + box[0]

    with pytest.raises(RuntimeError, match="used outside it"):
        trace(Leaks(), torch.ones(3))
