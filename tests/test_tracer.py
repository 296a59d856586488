"""Adversarial tests of the capture tracer and the runner code generator.

Each test calls `capture()` the way the C side does on a cache miss (the frame's bound
argument slots, in CPython's order) and then calls the runner the way a cache hit does
(`runner(*slots, *training_flags)`), comparing both with eager PyTorch.
"""

from __future__ import annotations

import builtins
import gc
import inspect
import linecache
import sys
import threading
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler_eval.tracing import trace_patches
from nnscaler_eval.runtime import ifexpr
from nnscaler_eval.tracing.trace_state import current_tracer
from nnscaler_eval.capture import Capture, GraphBreakError, capture

THIS_FILE = __file__


# ---------------------------------------------------------------------------
# Helpers: what the C side does


def frame_slots(fn: Callable[..., Any], *args: Any, **kwargs: Any):
    """The slots of a frame of `fn` called with these arguments, in CPython's order
    (positional, keyword-only, *args, **kwargs), their names, and a call that runs fn
    with them rebound."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    code = fn.__code__
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    names = code.co_varnames[:count]
    slots = tuple(bound.arguments[name] for name in names)
    return slots, tuple(names), (lambda: fn(*bound.args, **bound.kwargs))


def trace(module: nn.Module, *args: Any, fullgraph: bool = False, **kwargs: Any) -> Capture:
    fn = type(module).forward
    slots, names, call = frame_slots(fn, module, *args, **kwargs)
    return capture(fn, slots, names, root=module, fullgraph=fullgraph, call=call)


def flags(cap: Capture) -> list[bool]:
    return [bool(m.training) for m in cap.training_inputs]


def replay(cap: Capture, module: nn.Module, *args: Any, runner=None, **kwargs: Any) -> Any:
    slots, _, _ = frame_slots(type(module).forward, module, *args, **kwargs)
    runner = runner or cap.make_runner()
    return runner(*slots, *flags(cap))


def line_of(marker: str) -> int:
    with open(THIS_FILE) as source:
        for number, line in enumerate(source, start=1):
            if line.rstrip().endswith(f"# <{marker}>"):
                return number
    raise AssertionError(marker)


def assert_close(a: Any, b: Any) -> None:
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def assert_nothing_patched() -> None:
    assert trace_patches.active_traces() == 0
    assert nn.Module.__call__ is nn.Module._wrapped_call_impl
    assert nn.Module.__setattr__.__module__ == "torch.nn.modules.module"
    assert builtins.print.__module__ == "builtins"
    assert torch._C._set_grad_enabled is trace_patches.REAL_SET_GRAD_ENABLED
    assert torch.dropout is torch._C._VariableFunctions.dropout
    assert torch._VF.vf is torch._C._VariableFunctions
    assert (
        torch.autograd.Function.__dict__["apply"].__func__.__module__ == "torch.autograd.function"
    )
    assert torch.cond is torch._higher_order_ops.cond
    assert torch.jit.ScriptFunction.__call__ is trace_patches._original_script_function_call
    assert current_tracer() is None


def assert_training_restored(module: nn.Module) -> None:
    for m in module.modules():
        assert type(m.__dict__["training"]) is bool, m


@pytest.fixture(autouse=True)
def clean_state():
    assert_nothing_patched()
    grad = torch.is_grad_enabled()
    yield
    assert torch.is_grad_enabled() == grad
    assert_nothing_patched()


# ---------------------------------------------------------------------------
# Models


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Block(nn.Module):
    """A transformer block whose attention dropout goes through `ifexpr`, as the
    bytecode rewrite produces it from `self.p if self.training else 0.0`."""

    def __init__(self, dim: int = 16, heads: int = 4, p: float = 0.3) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(p)
        )

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=ifexpr(self.training, self.p, 0.0), is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.mlp(self.ln2(x))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.head(x.mean(dim=(2, 3)))


# ---------------------------------------------------------------------------
# Equal to eager


def test_mlp_runner_equals_eager():
    model = MLP()
    x = torch.randn(5, 8)
    cap = trace(model, x)
    assert cap.fallback is None
    assert_close(cap.result, model(x))
    assert_close(replay(cap, model, x), model(x))
    x2 = torch.randn(5, 8)
    assert_close(replay(cap, model, x2), model(x2))
    assert cap.visited_modules == [model, model.fc1, model.fc2]
    assert cap.training_inputs == [] and cap.branched_training == []
    assert_training_restored(model)


def test_generated_source_is_readable():
    model = MLP()
    cap = trace(model, torch.randn(2, 8))
    runner = cap.make_runner()
    source = inspect.getsource(runner)
    lines = [line.strip() for line in source.splitlines()]
    assert lines[0] == "def forward(self, x):"
    # one user line, each value used once by the next call: as eager code reads
    assert "linear_1 = F_linear(torch_relu(F_linear(x, fc1_weight, fc1_bias)), " \
           "fc2_weight, fc2_bias)" in lines
    assert lines[-1] == "return linear_1"
    # Each block names the user's line that produced it.
    assert any(
        line.startswith("# test_tracer.py:") and "self.fc2(torch.relu(self.fc1(x)))" in line
        for line in lines
    )
    filename = runner.__code__.co_filename
    assert filename.startswith("<nnscaler graph MLP.forward")
    assert linecache.getline(filename, 1).startswith("def forward")
    # Parameters are globals of the runner: no attribute chain per call.
    assert runner.__globals__["fc1_weight"] is model.fc1.weight


def test_transformer_block_both_modes_one_capture():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 6, 16)
    torch.manual_seed(1)
    expected = model(x)
    torch.manual_seed(1)
    cap = trace(model, x)
    assert cap.fallback is None
    assert_close(cap.result, expected)  # the traced run is the eager run
    # Training only reaches values: one placeholder per module, no branch.
    assert cap.branched_training == []
    assert cap.training_inputs == [model, model.drop, model.mlp[3]]
    targets = [n.target for n in cap.graph_module.graph.nodes if n.op == "call_function"]
    assert ifexpr in targets

    runner = cap.make_runner()
    torch.manual_seed(1)
    assert_close(replay(cap, model, x, runner=runner), expected)  # same dropout masks
    model.eval()
    assert_close(replay(cap, model, x, runner=runner), model(x))
    model.train()
    model.drop.eval()  # a submodule's flag is its own
    torch.manual_seed(3)
    expected = model(x)
    torch.manual_seed(3)
    assert_close(replay(cap, model, x, runner=runner), expected)


def test_dropout_masks_follow_the_seed():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(4, 8)
    torch.manual_seed(7)
    expected = model(x)
    torch.manual_seed(7)
    cap = trace(model, x)
    assert torch.equal(cap.result, expected)
    torch.manual_seed(7)
    assert torch.equal(replay(cap, model, x), expected)
    torch.manual_seed(8)
    assert not torch.equal(replay(cap, model, x), expected)


def test_batchnorm_statistics_match_eager_after_many_steps():
    torch.manual_seed(0)
    traced, eager = ConvNet(), ConvNet()
    eager.load_state_dict(traced.state_dict())
    inputs = [torch.randn(4, 3, 6, 6) for _ in range(5)]
    cap = trace(traced, inputs[0])  # step 1, for real
    assert cap.fallback is None
    assert (traced.bn, True) in cap.branched_training
    runner = cap.make_runner()
    outputs = [cap.result] + [replay(cap, traced, x, runner=runner) for x in inputs[1:]]
    for x, out in zip(inputs, outputs):
        assert_close(out, eager(x))
    assert_close(traced.bn.running_mean, eager.bn.running_mean)
    assert_close(traced.bn.running_var, eager.bn.running_var)
    assert int(traced.bn.num_batches_tracked) == int(eager.bn.num_batches_tracked) == 5


def test_frozen_batchnorm_inside_training_model():
    model = ConvNet()
    model.train()
    model.bn.eval()
    mean_before = model.bn.running_mean.clone()
    x = torch.randn(2, 3, 5, 5)
    cap = trace(model, x)
    assert cap.fallback is None
    assert (model.bn, False) in cap.branched_training
    assert model.bn.num_batches_tracked.item() == 0
    assert_close(replay(cap, model, x), model(x))
    assert torch.equal(model.bn.running_mean, mean_before)


def test_containers_and_shared_submodules():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shared = nn.Linear(6, 6)
            self.seq = nn.Sequential(shared, nn.Tanh(), shared)
            self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])
            self.heads = nn.ModuleDict({"a": nn.Linear(6, 2), "b": nn.Linear(6, 3)})
            self.tied = nn.Linear(6, 6, bias=False)
            self.tied.weight = self.layers[0].weight

        def forward(self, x):
            x = self.seq(x)
            for layer in self.layers:
                x = x + layer(x)
            x = self.tied(x)
            return {name: head(x) for name, head in self.heads.items()}

    model = Net()
    x = torch.randn(3, 6)
    cap = trace(model, x)
    assert cap.fallback is None
    out = replay(cap, model, x)
    assert set(out) == {"a", "b"}
    assert_close(out, model(x))
    # The shared module is visited once; the tied weight is one get_attr.
    assert len(cap.visited_modules) == len({id(m) for m in cap.visited_modules})
    weights = [n.target for n in cap.graph_module.graph.nodes if n.op == "get_attr"]
    assert weights.count("layers.0.weight") == 1 and "tied.weight" not in weights


def test_keyword_none_and_container_inputs_tuple_and_dict_outputs():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, pair, *extra, mask=None, scale: float = 1.0, **named):
            y = self.fc(x) * scale + pair[0] - pair[1]
            if mask is not None:
                y = y * mask
            for t in extra:
                y = y + t
            return y, {"sum": y.sum(), "named": named["bias"] + 1, "none": None}, (scale, "tag")

    model = Net()
    x = torch.randn(2, 4)
    pair = (torch.randn(2, 4), torch.randn(2, 4))
    extra = (torch.randn(2, 4),)
    bias = torch.randn(4)
    cap = trace(model, x, pair, *extra, mask=None, scale=2.0, bias=bias)
    assert cap.fallback is None
    assert cap.slot_names == ("self", "x", "pair", "mask", "scale", "extra", "named")
    expected = model(x, pair, *extra, scale=2.0, bias=bias)
    got = replay(cap, model, x, pair, *extra, mask=None, scale=2.0, bias=bias)
    assert_close(got[:2], expected[:2])
    assert got[1]["none"] is None and got[2] == (2.0, "tag")
    # New values for the same structure flow through.
    pair2 = (torch.randn(2, 4), torch.randn(2, 4))
    assert_close(
        replay(cap, model, x, pair2, *extra, scale=2.0, bias=bias)[:2],
        model(x, pair2, *extra, scale=2.0, bias=bias)[:2],
    )
    assert len(cap.example_inputs()) == 5  # x, pair[0], pair[1], extra[0], named['bias']


def test_named_tuple_output_uses_a_bound_spec():
    from collections import namedtuple

    Out = namedtuple("Out", "logits aux")

    class Net(nn.Module):
        def forward(self, x):
            return Out(x * 2, x.max(dim=-1))

    model = Net()
    x = torch.randn(3, 4)
    cap = trace(model, x)
    got = replay(cap, model, x)
    assert type(got) is Out
    assert_close(got.logits, x * 2)
    assert_close(got.aux.values, x.max(dim=-1).values)


def test_in_place_ops_and_buffer_side_effects_happen_once_per_call():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            self.calls.add_(1)
            h = self.fc(x)
            h.relu_()
            h[:, 0] = 0.5
            h += 1
            h.mul_(self.calls)
            return h

    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    cap = trace(model, x)
    assert cap.fallback is None
    assert_close(cap.result, reference(x))
    assert model.calls.item() == 1
    runner = cap.make_runner()
    for _ in range(3):
        assert_close(replay(cap, model, x, runner=runner), reference(x))
    assert model.calls.item() == reference.calls.item() == 4


def test_no_grad_region_inside_forward():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("ema", torch.zeros(4))

        def forward(self, x):
            y = self.fc(x)
            with torch.no_grad():
                self.ema.mul_(0.9).add_(y.mean(0), alpha=0.1)
                z = y * 2
            return y + z, z

    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    cap = trace(model, x)
    assert cap.fallback is None
    targets = [n.target for n in cap.graph_module.graph.nodes]
    assert targets.count(torch._C._set_grad_enabled) == 2
    expected = reference(x)
    got = replay(cap, model, x)
    assert_close(got, reference(x))
    assert got[0].requires_grad and not got[1].requires_grad
    assert_close(model.ema, reference.ema)
    assert torch.is_grad_enabled()
    # An error inside the no_grad region leaves grad mode as eager would: enabled.
    with pytest.raises(RuntimeError):
        replay(cap, model, torch.randn(3, 5))
    assert torch.is_grad_enabled()
    del expected


def test_autocast_region_inside_forward():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = self.fc(x)
            return y.float() + x, y.dtype

    model = Net()
    x = torch.randn(2, 8)
    cap = trace(model, x)
    assert cap.fallback is None
    got = replay(cap, model, x)
    assert_close(got[0], model(x)[0])
    assert got[1] == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_tensor_operators_methods_and_tuple_results():
    class Net(nn.Module):
        def forward(self, x):
            a = 2 - x
            b = -(x**2) / 3
            c = x.T @ x
            d = x[:, 1:3] * x[..., None, 0]
            values, indices = x.max(dim=1)
            parts = torch.split(x, 2, dim=1)
            rows = [row.sum() for row in x]
            mask = (x > 0) & (x < 1)
            return (
                a,
                b,
                c,
                d,
                values,
                indices,
                parts[1],
                torch.stack(rows),
                mask,
                x.size(0) * x.dim(),
            )

    model = Net()
    x = torch.randn(4, 5)
    cap = trace(model, x)
    assert cap.fallback is None
    assert_close(replay(cap, model, x), model(x))
    source = cap.runner_source()
    assert "sub = 2 - x" in source
    assert "x[:, 1:3]" in source


class _Inlining(nn.Module):
    def forward(self, x, y):
        b = x.relu().sin()             # relu: used once, by the next call, first: inlined
        c = (b * b).cos()              # b used twice: a name; b * b inlined into cos
        d = (y + c.cos()).exp()        # c.cos() is not the add's first argument: a name
        f = d.sum(-1) + d.mean(-1)     # d used twice: a name
        g = f.neg()
        return g.abs(), f              # g is used by the next call, from another line


def test_single_use_values_are_written_into_their_use():
    model = _Inlining()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    cap = trace(model, x, y)
    source = cap.runner_source()
    body = [line.strip() for line in source.splitlines()
            if line.strip() and not line.strip().startswith("#")]
    assert "sin = x.relu().sin()" in body, source
    assert "cos = sin.mul(sin).cos(); sin = None" in body, source
    assert "cos_1 = cos.cos(); cos = None" in body, source
    assert "exp = y.add(cos_1).exp(); cos_1 = None" in body, source
    assert "neg = add_1.neg()" in body, source
    assert any(line.startswith("abs_1 = neg.abs(); neg = None") for line in body), source
    assert_close(replay(cap, model, x, y), model(x, y))


def test_autograd_through_the_runner_matches_eager():
    torch.manual_seed(0)
    model = Block(p=0.0)
    x = torch.randn(2, 5, 16, requires_grad=True)
    cap = trace(model, x)
    model.zero_grad()
    replay(cap, model, x).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    x_grad = x.grad.clone()
    model.zero_grad()
    x.grad = None
    model(x).square().sum().backward()
    for name, param in model.named_parameters():
        assert_close(grads[name], param.grad)
    assert_close(x_grad, x.grad)


def test_autograd_function_is_one_node_and_keeps_its_backward():
    class StraightThrough(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.round()

        @staticmethod
        def backward(ctx, grad):
            return grad * 3

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return StraightThrough.apply(self.fc(x)) * 2

    model = Net()
    x = torch.randn(3, 4)
    cap = trace(model, x)
    assert cap.fallback is None
    nodes = list(cap.graph_module.graph.nodes)
    applies = [
        n for n in nodes if getattr(n.target, "__qualname__", "").endswith("StraightThrough.apply")
    ]
    assert len(applies) == 1
    assert "round" not in [n.target for n in nodes]  # its forward is not inlined
    runner = cap.make_runner()
    # its Python (apply, forward) runs with the evaluator out of the way at hits
    assert "C_call_disarmed(fn_" in inspect.getsource(runner)
    replay(cap, model, x, runner=runner).sum().backward()
    grad = model.fc.weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    assert_close(grad, model.fc.weight.grad)
    assert grad.abs().sum() > 0


@torch.jit.script
def scripted_bias_gelu(x, bias):
    y = x + bias
    return y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))


def test_torchscript_is_opaque_never_a_baked_constant():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.jit.script(nn.Linear(4, 4))
            self.bias = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return scripted_bias_gelu(self.proj(x), self.bias)

    model = Net()
    with torch.no_grad():  # no grad_fn to betray an unseen computation
        cap = trace(model, torch.randn(2, 4))
        assert cap.fallback is None and cap.opaque_modules == [model.proj]
        x = torch.randn(2, 4)
        assert_close(replay(cap, model, x), model(x))
    assert "scripted_bias_gelu(" in cap.runner_source()


def test_lstm_passes_its_flag_straight_to_c():
    torch.manual_seed(0)
    model = nn.LSTM(6, 5, num_layers=2, dropout=0.5, batch_first=True)
    x = torch.randn(2, 7, 6)
    torch.manual_seed(1)
    expected = model(x)
    torch.manual_seed(1)
    cap = trace(model, x)
    assert cap.fallback is None and cap.training_inputs == [model]
    assert_close(cap.result, expected)
    runner = cap.make_runner()
    torch.manual_seed(1)
    assert_close(replay(cap, model, x, runner=runner), expected)
    model.eval()
    assert_close(replay(cap, model, x, runner=runner), model(x))


def test_flags_given_to_c_functions_with_bool_parameters():
    class Net(nn.Module):
        def forward(self, x):
            y = torch.dropout(x, 0.5, self.training)  # a value: graph input
            with torch.set_grad_enabled(self.training):  # grad mode: a branch
                return y * 2

    model = Net()
    x = torch.ones(500, requires_grad=True)
    cap = trace(model, x)
    assert cap.fallback is None
    assert cap.training_inputs == [model] and cap.branched_training == [(model, True)]
    out = replay(cap, model, x)
    assert out.requires_grad and (out == 0).any()


def test_tensor_hooks_registered_in_forward_replay():
    class Net(nn.Module):
        def forward(self, x):
            y = x * 2
            y.register_hook(lambda grad: grad * 10)
            return y.sum()

    model = Net()
    x = torch.ones(3, requires_grad=True)
    cap = trace(model, x)
    assert cap.fallback is None
    x.grad = None
    replay(cap, model, x).backward()
    assert torch.equal(x.grad, torch.full((3,), 20.0))


# ---------------------------------------------------------------------------
# self.training


def test_training_branch_specialises():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if self.training:
                return self.fc(x) * 2
            return self.fc(x)

    model = Net()
    cap = trace(model, torch.randn(2, 4))
    assert cap.branched_training == [(model, True)]
    assert cap.training_inputs == []
    model.eval()
    cap_eval = trace(model, torch.randn(2, 4))
    assert cap_eval.branched_training == [(model, False)]
    x = torch.randn(2, 4)
    assert_close(replay(cap_eval, model, x), model(x))


def test_training_in_boolean_expressions_and_comparisons_specialises():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enable = False
            self.child = nn.Dropout(0.2)

        def forward(self, x):
            y = F.dropout(x, 0.5, self.enable or self.training)
            if self.child.training == True:  # noqa: E712 - a comparison, on purpose
                y = y + 1
            return y * int(not self.training)

    model = Net()
    cap = trace(model, torch.randn(3))
    assert {id(m) for m, _ in cap.branched_training} == {id(model), id(model.child)}
    assert_training_restored(model)


def test_training_as_a_value_reaches_torch_functions():
    class Net(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, self.training), torch.tensor(self.training)

    model = Net()
    x = torch.ones(1000)
    cap = trace(model, x)
    assert cap.training_inputs == [model] and cap.branched_training == []
    runner = cap.make_runner()
    out, flag = runner(model, x, True)
    assert (out == 0).any() and flag.item() is True
    out, flag = runner(model, x, False)
    assert torch.equal(out, x) and flag.item() is False


def test_ifexpr_on_tensors_keeps_the_branches_apart():
    class Net(nn.Module):
        def forward(self, a, b):
            chosen = ifexpr(self.training, a, b)
            return chosen + a  # `a` is still `a`, not the ifexpr

    model = Net()
    a, b = torch.randn(3), torch.randn(3)
    cap = trace(model, a, b)
    runner = cap.make_runner()
    assert_close(runner(model, a, b, True), a + a)
    assert_close(runner(model, a, b, False), b + a)


def test_tracked_number_used_in_python_specialises():
    class Net(nn.Module):
        def forward(self, x):
            p = ifexpr(self.training, 0.1, 0.0)
            y = F.dropout(x, p=p)  # a value: graph input
            return y * (p + 1)  # arithmetic in Python: a branch on training

    model = Net()
    cap = trace(model, torch.ones(4))
    assert cap.training_inputs == [model]
    assert cap.branched_training == [(model, True)]


def test_flags_and_tracked_numbers_never_leave_the_trace():
    class Net(nn.Module):
        def forward(self, x):
            return x * 2, self.training, ifexpr(self.training, 0.5, 0.0)

    model = Net()
    cap = trace(model, torch.ones(1))
    _, training, p = cap.result
    assert type(training) is bool and training is True
    assert type(p) is float and p == 0.5
    runner = cap.make_runner()
    assert runner(model, torch.ones(1), False)[1:] == (False, 0.0)


def test_ifexpr_with_unrecordable_values_specialises():
    class Net(nn.Module):
        def forward(self, x):
            mask = ifexpr(self.training, None, x > 0)
            return x if mask is None else x * mask

    model = Net()
    cap = trace(model, torch.randn(3))
    assert cap.branched_training == [(model, True)] and cap.training_inputs == []


def test_call_opaque_records_one_node_and_tracks_numbers():
    calls = []

    def get_dropout(module, p):
        calls.append(p)
        return p if module.training else 0.0

    class Net(nn.Module):
        def forward(self, x):
            p = (
                current_tracer().call_opaque(get_dropout, (self, 0.25), {})
                if current_tracer()
                else get_dropout(self, 0.25)
            )
            return F.dropout(x, p)

    model = Net()
    x = torch.ones(2000)
    cap = trace(model, x)
    assert cap.fallback is None and cap.branched_training == []
    nodes = [n for n in cap.graph_module.graph.nodes if n.target is get_dropout]
    assert len(nodes) == 1
    runner = cap.make_runner()
    model.eval()
    assert torch.equal(runner(model, x), x)  # get_dropout runs per call, sees eval
    model.train()
    assert (runner(model, x) == 0).any()
    assert len(calls) == 3


# ---------------------------------------------------------------------------
# Hooks


def test_submodule_with_forward_hook_is_opaque_and_hook_runs_every_call():
    model = MLP()
    seen = []

    def hook(module, inputs, output):
        seen.append(output.shape)
        return output * 10

    handle = model.fc1.register_forward_hook(hook)
    x = torch.randn(3, 8)
    cap = trace(model, x)
    assert cap.fallback is None
    assert cap.opaque_modules == [model.fc1]
    assert len(seen) == 1  # the traced run called it, once
    calls = [n for n in cap.graph_module.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls] == ["fc1"]
    runner = cap.make_runner()
    assert "C_call_hooked(self._modules['fc1'], (x, ), {})" in inspect.getsource(runner)
    assert_close(replay(cap, model, x, runner=runner), model(x))
    assert len(seen) == 3
    handle.remove()


def test_global_hook_makes_every_submodule_opaque():
    model = MLP()
    count = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: count.append(m))
    try:
        x = torch.randn(2, 8)
        cap = trace(model, x)
        assert cap.opaque_modules == [model.fc1, model.fc2]
        count.clear()
        replay(cap, model, x)
        assert count == [model.fc1, model.fc2]
    finally:
        handle.remove()


def test_runner_never_holds_the_model():
    model = MLP()
    model.fc2.register_forward_pre_hook(lambda m, i: None)
    x = torch.randn(2, 8)
    cap = trace(model, x)
    runner = cap.make_runner()
    assert not any(isinstance(v, nn.Module) for v in runner.__globals__.values())
    alive = weakref.ref(model)
    del model, cap
    gc.collect()
    assert alive() is None
    assert runner  # still usable by whoever holds slots


# ---------------------------------------------------------------------------
# Fallbacks


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # <data-branch>
            return y * 2
        return y - 1


def test_data_dependent_branch_falls_back_with_location():
    model = DataDependent()
    x = torch.randn(2, 4)
    cap = trace(model, x)
    assert cap.graph_module is None
    assert cap.fallback.reason == "data-dependent control flow: bool() of a tensor"
    assert (cap.fallback.filename, cap.fallback.lineno) == (THIS_FILE, line_of("data-branch"))
    assert str(cap.fallback).endswith(f"at {THIS_FILE}:{line_of('data-branch')}")
    assert_close(cap.result, model(x))  # the run finished for real
    with pytest.raises(RuntimeError, match="fell back"):
        cap.make_runner()
    assert_training_restored(model)


def test_fullgraph_raises_graph_break_error():
    model = DataDependent()
    with pytest.raises(GraphBreakError) as info:
        trace(model, torch.randn(2, 4), fullgraph=True)
    assert f"{THIS_FILE}:{line_of('data-branch')}" in str(info.value)
    assert "bool() of a tensor" in str(info.value)
    assert_training_restored(model)


def test_item_falls_back():
    class Net(nn.Module):
        def forward(self, x):
            scale = x.max().item()  # <item>
            return x / scale

    model = Net()
    x = torch.rand(3) + 1
    cap = trace(model, x)
    assert "Tensor.item()" in cap.fallback.reason
    assert cap.fallback.lineno == line_of("item")
    assert_close(cap.result, model(x))


def test_data_dependent_shape_query_falls_back():
    class Net(nn.Module):
        def forward(self, x):
            picked = x[x > 0]
            return picked * picked.shape[0]  # <dyn-shape>

    cap = trace(Net(), torch.randn(10))
    assert "data-dependent shape" in cap.fallback.reason
    assert cap.fallback.lineno == line_of("dyn-shape")


def test_print_falls_back_and_prints_once(capsys):
    class Net(nn.Module):
        def forward(self, x):
            print("shape", tuple(x.shape))  # <print>
            return x + 1

    model = Net()
    cap = trace(model, torch.zeros(2))
    assert cap.fallback.lineno == line_of("print")
    assert "print()" in cap.fallback.reason
    assert capsys.readouterr().out == "shape (2,)\n"


def test_breakpoint_falls_back(monkeypatch):
    hits = []
    monkeypatch.setattr(sys, "breakpointhook", lambda *a, **k: hits.append(1))

    class Net(nn.Module):
        def forward(self, x):
            breakpoint()  # noqa: T100  # <breakpoint>
            return x * 3

    cap = trace(Net(), torch.ones(2))
    assert cap.fallback.reason == "breakpoint()" and cap.fallback.lineno == line_of("breakpoint")
    assert hits == [1]  # the user's hook still ran, once
    assert torch.equal(cap.result, torch.full((2,), 3.0))
    assert sys.breakpointhook is not trace_patches._breakpointhook


def test_module_state_writes_happen_once_kept_or_fall_back():
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.counter = 0
            self.history = []

        def forward(self, x):
            self.counter += 1
            return x + self.counter

    model = Counter()
    cap = trace(model, torch.zeros(1))
    # a plain value: kept for the runner to write again, the value before it noted
    assert cap.fallback is None
    assert [(name, before, value) for _, name, before, value in cap.state_writes] == [
        ("counter", 0, 1)]
    assert model.counter == 1 and cap.result.item() == 1.0
    assert "setattr(" in cap.runner_source()

    class Logger(Counter):
        def forward(self, x):
            self.history = self.history + [1]  # <history>
            return x

    cap = trace(Logger(), torch.zeros(1))
    assert cap.fallback.lineno == line_of("history")
    assert "Logger.history" in cap.fallback.reason

    class Sneaky(Counter):
        def forward(self, x):
            self.__dict__["counter"] = 5
            return x

    cap = trace(Sneaky(), torch.zeros(1))
    assert cap.fallback is not None and "counter" in cap.fallback.reason

    class Appender(Counter):
        def forward(self, x):
            self.history.append(x)
            return x

    cap = trace(Appender(), torch.zeros(1))
    assert cap.fallback is not None and "history" in cap.fallback.reason


def test_torch_cond_with_a_tensor_predicate_is_one_node():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if torch.cond(x.dim() == 2, lambda t: t + 1, lambda t: t - 1, (x,)).dim() != 2:
                raise AssertionError("a Python predicate picks its branch inline")
            positive, negative = (lambda t: self.fc(t) * 2), (lambda t: self.fc(t) - 1)
            return torch.cond(x.sum() > 0, positive, negative, (x,))

    model = Net()
    x = torch.randn(2, 4)
    cap = trace(model, x)
    assert cap.fallback is None
    conds = [n for n in cap.graph_module.graph.nodes if n.target is torch.ops.higher_order.cond]
    assert len(conds) == 1
    assert_close(cap.result, model(x))
    for sign in (1.0, -1.0):
        y = sign * (x.abs() + 1)
        assert_close(replay(cap, model, y), model(y))


def test_tensors_hidden_in_plain_objects_are_refused():
    class Box:
        def __init__(self, t):
            self.t = t

    def fn(box):
        return box.t * 2

    cap = capture(fn, (Box(torch.ones(2)),), ("box",), root=None)
    assert cap.fallback is not None and "Box" in cap.fallback.reason


# ---------------------------------------------------------------------------
# Cleanup, exceptions, threads


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        self.fc(x)
        raise ValueError("boom")  # <raise>


def test_exceptions_propagate_and_everything_is_restored():
    model = Raises()
    with pytest.raises(ValueError, match="boom") as info:
        trace(model, torch.ones(2))
    frames = [
        (f.filename, f.lineno) for f in __import__("traceback").extract_tb(info.value.__traceback__)
    ]
    assert frames[-1] == (THIS_FILE, line_of("raise"))
    assert_training_restored(model)
    # errors raised by a torch op keep their type too
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        trace(MLP(), torch.ones(2, 3))


def test_eager_thread_is_unaffected_by_a_trace_on_another_thread():
    inside = threading.Event()
    release = threading.Event()

    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            y = self.fc(x)
            inside.set()
            assert release.wait(10)
            return self.drop(y)

    traced = Slow()
    results: dict[str, Any] = {}

    def tracing_thread():
        results["capture"] = trace(traced, torch.randn(2, 4))

    thread = threading.Thread(target=tracing_thread)
    thread.start()
    assert inside.wait(10)
    try:
        # Meanwhile, on this thread: eager modules, prints, state writes, hooks.
        assert trace_patches.active_traces() == 1
        eager = Slow()
        eager.eval()
        eager.counter = 1
        x = torch.randn(2, 4)
        assert torch.equal(eager.drop(eager.fc(x)), F.linear(x, eager.fc.weight, eager.fc.bias))
        assert type(eager.training) is bool
        print("eager thread prints normally")
    finally:
        release.set()
        thread.join()
    cap = results["capture"]
    assert cap.fallback is None
    assert cap.training_inputs == [traced.drop]


def test_two_threads_tracing_at_once():
    barrier = threading.Barrier(2, timeout=10)
    meeting = [barrier]  # emptied once both traces are done

    class Meeting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            y = self.fc(x)
            for place in meeting:
                place.wait()  # both traces are inside forward now
            return self.drop(y) * 2

    models = [Meeting(), Meeting()]
    captures: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            captures[i] = trace(models[i], torch.randn(2, 4))
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    meeting.clear()
    for model, cap in zip(models, captures):
        assert cap.fallback is None and cap.training_inputs == [model.drop]
        model.eval()
        x = torch.randn(3, 4)
        assert_close(replay(cap, model, x), model(x))


def test_errors_in_a_runner_point_at_generated_source():
    model = MLP()
    cap = trace(model, torch.randn(2, 8))
    runner = cap.make_runner()
    with pytest.raises(RuntimeError) as info:
        runner(model, torch.randn(2, 3))
    text = "".join(__import__("traceback").format_exception(info.value))
    assert "<nnscaler graph MLP.forward" in text
    assert "F_linear(x, fc1_weight, fc1_bias)" in text
    assert "^^^" in text   # the failing call within the line (3.11+ positions)


def test_linecache_entries_belong_to_their_runner():
    model = MLP()
    cap = trace(model, torch.randn(2, 8))
    first = cap.make_runner()
    name = first.__code__.co_filename
    del first
    gc.collect()
    assert name not in linecache.cache  # freed with its runner
    second = cap.make_runner()
    third = cap.make_runner()
    assert second.__code__.co_filename != third.__code__.co_filename
    del third
    gc.collect()
    assert inspect.getsource(second).startswith("def forward")


def test_plain_function_capture_without_root():
    hooked = nn.Linear(3, 3)
    hooked.register_forward_hook(lambda m, i, o: o + 1)
    weight = torch.randn(3, 3)

    def fn(x, y=None):
        return hooked(x @ weight) + (0 if y is None else y)

    x = torch.randn(2, 3)
    cap = capture(fn, (x, None), ("x", "y"), root=None)
    assert cap.fallback is None and cap.opaque_modules == [hooked]
    runner = cap.make_runner()
    assert_close(runner(x, None), fn(x))


def test_compiled_graph_path_and_example_inputs():
    model = Block(p=0.1)
    x = torch.randn(2, 4, 16)
    cap = trace(model, x)
    example = cap.example_inputs()
    placeholders = [n for n in cap.graph_module.graph.nodes if n.op == "placeholder"]
    assert len(example) == len(placeholders) == 1 + len(cap.training_inputs)
    seen = []

    def compiled(*args):
        seen.append(len(args))
        return cap.graph_module(*args)

    runner = cap.make_runner(compiled)
    model.eval()
    assert_close(replay(cap, model, x, runner=runner), model(x))
    assert seen == [len(placeholders)]


def test_a_no_grad_block_is_recorded_as_torchs_own_set_grad_enabled():
    """torch 2.13's _set_grad_enabled hands itself to function modes by its name in
    torch._C, which is our replacement while a trace runs: recorded, each change was a
    second node calling a function of ours (in exports too, and no compiler cache keys
    a function of ours)."""
    class NoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            with torch.no_grad():
                y = self.fc(x)
            return y * x

    model = NoGrad()
    x = torch.randn(2, 8)
    cap = trace(model, x)
    targets = [n.target for n in cap.graph_module.graph.nodes if n.op == "call_function"
               and "grad_enabled" in getattr(n.target, "__name__", "")]
    assert targets == [torch._C._set_grad_enabled] * 2
    assert_close(replay(cap, model, x), model(x))
    assert torch.is_grad_enabled()


def test_backend_graph_folds_training_for_aot_backends():
    from torch._dynamo.backends.registry import lookup_backend

    aot_eager = lookup_backend("aot_eager")
    model = Block(p=0.2).eval()
    x = torch.randn(2, 6, 16)
    cap = trace(model, x)
    gm, example = cap.backend_graph()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(example) == 1
    assert ifexpr not in [n.target for n in gm.graph.nodes]
    runner = cap.make_runner(aot_eager(gm, example), training_folded=True)
    assert_close(replay(cap, model, x, runner=runner), model(x))

    # Buffers mutated by the graph (BatchNorm statistics) stay live through AOT.
    traced, eager = ConvNet(), ConvNet()
    eager.load_state_dict(traced.state_dict())
    inputs = [torch.randn(2, 3, 6, 6) for _ in range(3)]
    cap = trace(traced, inputs[0])
    eager(inputs[0])
    runner = cap.make_runner(aot_eager(*cap.backend_graph()), training_folded=True)
    for x in inputs[1:]:
        torch.testing.assert_close(
            replay(cap, traced, x, runner=runner), eager(x), rtol=1e-5, atol=1e-5
        )
    assert_close(traced.bn.running_mean, eager.bn.running_mean)
    assert int(traced.bn.num_batches_tracked) == 3


def test_graph_module_keeps_live_parameters_and_leaves_model_untouched():
    model = ConvNet()
    model.bn.register_forward_hook(lambda m, i, o: o)
    keys = list(model.state_dict())
    cap = trace(model, torch.randn(2, 3, 4, 4))
    gm = cap.graph_module
    assert (
        gm.get_submodule("conv").weight is model.conv.weight or gm.conv.weight is model.conv.weight
    )
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        model.conv.weight.zero_()
        model.conv.bias.zero_()
    x = torch.randn(2, 3, 4, 4)
    model.eval()
    assert_close(replay(cap, model, x), model(x))  # in-place updates are seen
