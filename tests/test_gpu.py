"""CUDA paths (skipped without a GPU): eager / inductor / cudagraphs on CUDA tensors,
and the device guard between CPU and CUDA entries."""
from __future__ import annotations

import copy

import pytest
import torch

import nnscaler
from models import MLP, Block

pytestmark = pytest.mark.gpu
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_cuda_tensors_through_backends(backend):
    eager = Block().cuda().eval()
    model = nnscaler.compile(copy.deepcopy(eager), backend=backend)
    x = torch.randn(2, 8, 32, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(eager(x), model(x), **TOL)
    assert nnscaler.cache_info(model).hits >= 2


def test_cudagraphs_replays_with_new_inputs():
    eager = MLP().cuda().eval()
    model = nnscaler.compile(copy.deepcopy(eager), backend="cudagraphs")
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(4, 16, device="cuda")
            out = model(x)
            torch.testing.assert_close(eager(x), out, **TOL)
    assert nnscaler.cache_info(model).hits >= 3


def test_cpu_entry_is_not_used_for_cuda_inputs():
    model = nnscaler.compile(MLP())
    model(torch.randn(2, 16))
    model.cuda()
    out = model(torch.randn(2, 16, device="cuda"))
    assert out.is_cuda
    assert nnscaler.cache_info(model).captures == 2
