"""Backends: custom callables, torch.compile's named backends, failures, devices."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from models import MLP, Block

TOL = dict(rtol=1e-5, atol=1e-5)


def run_modes(eager, model, x, modes=("train", "eval", "train")):
    for mode in modes:
        getattr(eager, mode)()
        getattr(model, mode)()
        torch.manual_seed(1)
        a = eager(x)
        torch.manual_seed(1)
        b = model(x)
        torch.testing.assert_close(a, b, **TOL)
        a.square().sum().backward()
        b.square().sum().backward()
    for (n, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_custom_callable_backend_gets_graph_module_and_example_inputs():
    calls = []

    def backend(gm, example_inputs):
        calls.append((gm, example_inputs))
        return gm.forward

    eager = Block()
    model = nnscaler.compile(copy.deepcopy(eager), backend=backend)
    run_modes(eager, model, torch.randn(2, 8, 32))
    gm, example = calls[0]
    assert isinstance(gm, torch.fx.GraphModule)
    assert [tuple(t.shape) for t in example] == [(2, 8, 32)]
    # training flags are folded for compiled backends: one graph per mode
    assert len(calls) == 2 and nnscaler.cache_info(model).captures == 2


def test_aot_eager_outputs_and_gradients_equal_eager():
    eager = Block()
    model = nnscaler.compile(copy.deepcopy(eager), backend="aot_eager")
    run_modes(eager, model, torch.randn(2, 8, 32))
    assert nnscaler.cache_info(model).hits >= 1


def test_inductor_on_cpu():
    eager = MLP(8)
    model = nnscaler.compile(copy.deepcopy(eager), backend="inductor")
    run_modes(eager, model, torch.randn(4, 8), modes=("eval",))
    x = torch.randn(4, 8)
    torch.testing.assert_close(eager(x), model(x), **TOL)
    assert nnscaler.cache_info(model).hits >= 1


def test_raising_backend_gives_eager_results_and_one_warning():
    def broken(gm, example_inputs):
        raise RuntimeError("no kernels today")

    eager = MLP()
    model = nnscaler.compile(copy.deepcopy(eager), backend=broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (2, 3, 4):  # three captures, one warning
            x = torch.randn(n, 16)
            torch.testing.assert_close(eager(x), model(x), **TOL)
    messages = [str(w.message) for w in caught if "no kernels today" in str(w.message)]
    assert len(messages) == 1 and "'broken'" in messages[0]
    assert caught[0].filename == __file__  # the warning names the user's line


def test_raising_backend_with_fullgraph_is_an_error_naming_it():
    def broken(gm, example_inputs):
        raise RuntimeError("no kernels today")

    model = nnscaler.compile(MLP(), backend=broken, fullgraph=True)
    with pytest.raises(RuntimeError, match="backend 'broken' failed"):
        model(torch.randn(2, 16))
    # nothing lost: the library stays usable
    ok = nnscaler.compile(MLP())
    ok(torch.randn(2, 16))


def test_backend_returning_a_non_callable_is_reported():
    model = nnscaler.compile(MLP(), backend=lambda gm, ex: 42)
    with pytest.warns(RuntimeWarning, match="not a callable"):
        model(torch.randn(2, 16))


def test_cudagraphs_without_cuda_falls_back_with_a_clear_message():
    eager = MLP()
    model = nnscaler.compile(copy.deepcopy(eager), backend="cudagraphs")
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="cudagraphs needs"):
        torch.testing.assert_close(eager(torch.ones(2, 16)), model(torch.ones(2, 16)))


def test_device_is_part_of_the_key():
    """An entry captured for CPU tensors is not used for another device (meta
    tensors stand in for CUDA on a CPU-only machine)."""
    model = nnscaler.compile(nn.Linear(4, 4))
    model(torch.randn(2, 4))
    with torch.device("meta"):
        meta_model = nn.Linear(4, 4)
    nnscaler.compile(meta_model)
    out = meta_model(torch.randn(2, 4, device="meta"))
    assert out.device.type == "meta"
    model.to("meta")
    out = model(torch.randn(2, 4, device="meta"))
    assert out.device.type == "meta"
    assert nnscaler.cache_info(model).captures == 2


def test_register_op_stays_one_node_under_compile_in_both_modes():
    @nnscaler.register_op("?, ? -> ?", name="test_backends.get_dropout")
    def get_dropout(training, dropout):
        return dropout if training else 0.0

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.dropout = 0.5

        def forward(self, q):
            return F.scaled_dot_product_attention(
                q, q, q, dropout_p=get_dropout(self.training, self.dropout))

    eager = Attn()
    model = nnscaler.compile(Attn())
    q = torch.randn(1, 2, 4, 8)
    for mode in ("train", "eval", "train"):
        getattr(eager, mode)()
        getattr(model, mode)()
        torch.manual_seed(3)
        a = eager(q)
        torch.manual_seed(3)
        torch.testing.assert_close(a, model(q), **TOL)
    report = nnscaler.explain(model, q)
    graph = report.graphs[0].graph
    ops = [n for n in graph.nodes if getattr(n.target, "__nnscaler_op__", None) is not None]
    assert len(ops) == 1
    assert "get_dropout" in str(report)
