"""`torch.library.custom_op` ops (how users bring their own kernels) are captured as
one node each, statically and with symbolic sizes, in training too.

Such an op runs its implementation through an autograd.Function of torch's: that
Function is inside the op's node, not a call of the forward's beside it (it used to be
recorded as one, on the data-dependence check's fakes, and the whole forward ran
eagerly).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nnscaler
from oracle import agree, assert_same, twins


@torch.library.custom_op("nnscaler_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _scaled_tanh_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return grad * ctx.scale * (1 - (y / ctx.scale) ** 2), None


def _scaled_tanh_setup(ctx, inputs, output):
    ctx.scale = inputs[1]
    ctx.save_for_backward(output)


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)


@torch.library.custom_op("nnscaler_test::count_into", mutates_args=("counter",))
def count_into(x: torch.Tensor, counter: torch.Tensor) -> None:
    counter.add_(x.shape[0])


@count_into.register_fake
def _(x, counter):
    return None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        count_into(x, self.seen)
        return scaled_tanh(self.fc(x), 2.5) + x


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "symbolic"])
def test_custom_ops_are_one_node_each_and_agree_with_eager(dynamic):
    compiled, eager = twins(Block(), dynamic=dynamic)
    sizes = (5, 5, 9, 1, 13)
    for n in sizes:
        agree(compiled, eager, torch.randn(n, 8), rtol=1e-6, atol=1e-6)
        # The mutating op ran on every call, as in eager.
        assert compiled.seen.item() == eager.seen.item()
    info = nnscaler.cache_info(compiled)
    assert info.fallbacks == 0, info
    if dynamic:
        assert info.captures <= 3, info   # the first size, a symbolic one, size 1
    graph = compiled_graph_targets(compiled, torch.randn(4, 8))
    assert torch.ops.nnscaler_test.scaled_tanh.default in graph
    assert torch.ops.nnscaler_test.count_into.default in graph


def compiled_graph_targets(model: nn.Module, x: torch.Tensor) -> list:
    seen: list = []

    def backend(gm, example_inputs):
        seen.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm

    probe = nnscaler.compile(Block(), backend=backend)
    probe.load_state_dict(model.state_dict())
    probe(x)
    return seen


def test_a_custom_ops_autograd_trains_as_in_eager():
    compiled, eager = twins(Block())
    compiled.train()
    eager.train()
    for n in (6, 6, 3):
        x = torch.randn(n, 8)
        got = compiled(x)
        want = eager(x)
        assert_same(got, want, rtol=1e-6, atol=1e-6)
        got.square().sum().backward()
        want.square().sum().backward()
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            assert_same(p.grad, q.grad, rtol=1e-5, atol=1e-6, path=name)
    info = nnscaler.cache_info(compiled)
    assert info.fallbacks == 0 and info.captures >= 1, info
