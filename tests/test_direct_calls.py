"""Runners call torch's C entry points in place of its Python wrappers where that is
exactly what the wrapper would do (nnscaler_eval/runners/direct_calls.py): same results, same
random numbers, same gradients, same errors; a TorchFunctionMode or a tensor subclass
still sees the function the user called."""
from __future__ import annotations

import copy
import inspect
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import nnscaler
from nnscaler_eval import _C


def entry_runner(module: nn.Module):
    state = _C.code_state(type(module).forward.__code__) or {}
    for bucket in state.get("buckets", []):
        if bucket.self is module and bucket.entries:
            return bucket.entries[0].runner
    raise AssertionError("no cache entry for this module")


class Wrappers(nn.Module):
    """Each wrapper direct_calls.py knows, with the argument forms it lowers."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.inplace = inplace

    def forward(self, idx, x):
        h = self.emb(idx) + x
        h = self.norm(h)
        a, b = h.split(4, dim=-1)
        c, d = h.split([3, 5], dim=-1)
        h = torch.cat([F.relu(a.clone(), inplace=self.inplace),
                       F.silu(b.clone(), inplace=self.inplace),
                       c.softmax(-1), F.softmax(d, dim=-1, dtype=torch.float64).float()], -1)
        h = F.dropout(h, p=0.25, training=self.training, inplace=self.inplace)
        return F.softmax(h, dim=1)


def run_pair(model: nn.Module, *args, calls: int = 3):
    eager = copy.deepcopy(model)
    compiled = nnscaler.compile(model)
    for i in range(calls):
        torch.manual_seed(i)
        expected = eager(*args)
        torch.manual_seed(i)
        got = compiled(*args)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    return eager, compiled


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("inplace", [False, True])
def test_direct_calls_match_eager_bit_for_bit(mode, inplace):
    torch.manual_seed(0)
    model = getattr(Wrappers(inplace), mode)()
    idx = torch.randint(0, 10, (2, 5))
    x = torch.randn(2, 5, 8)
    eager, compiled = run_pair(model, idx, x)
    assert nnscaler.cache_info(compiled).hits >= 2
    source = inspect.getsource(entry_runner(compiled))
    for name in ("C_torch_embedding", "C_torch_layer_norm", "C_torch_split",
                 "C_torch_split_with_sizes", "C_torch_dropout", ".softmax("):
        assert name in source, name
    # gradients too (train mode, no in-place on leaves)
    if mode == "train" and not inplace:
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(5)
        eager(idx, x1).sum().backward()
        torch.manual_seed(5)
        compiled(idx, x2).sum().backward()
        torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=0)
        for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=n)


def test_a_hit_runs_no_python_frame_of_torch_for_these_ops():
    torch.manual_seed(0)
    model = Wrappers().train()
    idx = torch.randint(0, 10, (2, 5))
    x = torch.randn(2, 5, 8)
    compiled = nnscaler.compile(model)
    compiled(idx, x)
    compiled(idx, x)
    files: list[str] = []

    def profiler(frame, event, arg):
        if event == "call":
            files.append(frame.f_code.co_filename)

    sys.setprofile(profiler)
    try:
        compiled(idx, x)
    finally:
        sys.setprofile(None)
    torch_files = [f for f in files if f"{'torch'}{__import__('os').sep}" in f
                   and "torch/nn/modules/module.py" not in f]
    assert torch_files == []


class Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_at_hit_time_sees_the_wrappers_the_user_called():
    torch.manual_seed(0)
    model = Wrappers().train()
    idx = torch.randint(0, 10, (2, 5))
    x = torch.randn(2, 5, 8)
    eager, compiled = run_pair(model, idx, x, calls=2)
    with Recorder() as mode:
        torch.manual_seed(9)
        expected = eager(idx, x)
    with Recorder() as ours:
        torch.manual_seed(9)
        got = compiled(idx, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    wrappers = {F.dropout, F.layer_norm, F.embedding, F.softmax, F.relu, F.silu,
                torch.Tensor.split}
    assert [f for f in mode.seen if f in wrappers] == [f for f in ours.seen if f in wrappers]
    assert F.dropout in ours.seen and torch.Tensor.split in ours.seen


class Tagged(torch.Tensor):
    """A subclass that records which functions reach it."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


class DropSplit(nn.Module):
    def forward(self, x):
        a, b = x.split(2, dim=-1)
        return F.dropout(a, p=0.5, training=self.training) + b


def test_a_subclass_input_keeps_the_wrappers():
    model = DropSplit().train()
    eager = copy.deepcopy(model)
    compiled = nnscaler.compile(model)
    x = torch.randn(3, 4).as_subclass(Tagged)
    for i in range(3):
        Tagged.seen = []
        torch.manual_seed(i)
        expected = eager(x)
        eager_seen = list(Tagged.seen)
        Tagged.seen = []
        torch.manual_seed(i)
        got = compiled(x)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert F.dropout in Tagged.seen and torch.Tensor.split in Tagged.seen, Tagged.seen
        assert [f for f in Tagged.seen if f in (F.dropout, torch.Tensor.split)] == \
            [f for f in eager_seen if f in (F.dropout, torch.Tensor.split)]


def test_a_value_from_an_opaque_call_keeps_the_wrapper():
    """A registered op's result could change type at hit time: the wrapper it feeds
    stays, and decides."""
    @nnscaler.register_op("a^ -> a^")
    def passthrough_op(x: torch.Tensor) -> torch.Tensor:
        return x * 1

    class UsesOp(nn.Module):
        def forward(self, x):
            return F.dropout(passthrough_op(x), p=0.5, training=self.training) + \
                F.dropout(x, p=0.5, training=self.training)

    model = UsesOp().train()
    eager, compiled = run_pair(model, torch.randn(4, 4))
    source = inspect.getsource(entry_runner(compiled))
    assert source.count("C_torch_dropout(") == 1, source
    assert source.count("F_dropout(") == 2, source


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_a_probability_the_wrapper_rejects_raises_as_in_eager(p):
    class Bad(nn.Module):
        def forward(self, x):
            return F.dropout(x, p=p, training=True)

    with pytest.raises(ValueError, match="dropout probability"):
        Bad()(torch.ones(2))
    with pytest.raises(ValueError, match="dropout probability"):
        nnscaler.compile(Bad())(torch.ones(2))


def test_changing_cudnn_enabled_is_read_at_every_call(monkeypatch):
    """F.layer_norm passes torch.backends.cudnn.enabled as read at the call; the
    direct call reads the same getter each time."""
    model = nn.LayerNorm(8)
    compiled = nnscaler.compile(copy.deepcopy(model))
    x = torch.randn(2, 8)
    compiled(x)
    seen: list[bool] = []
    real = torch.layer_norm

    def spy(*args):
        seen.append(args[5])
        return real(*args)

    runner = entry_runner(compiled)
    name = next(k for k, v in runner.__globals__.items() if v is real)
    monkeypatch.setitem(runner.__globals__, name, spy)
    with torch.backends.cudnn.flags(enabled=False):
        compiled(x)
    with torch.backends.cudnn.flags(enabled=True):
        compiled(x)
    assert seen == [False, True]
