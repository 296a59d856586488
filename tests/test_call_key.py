"""The per-call key of tensor arguments (guards/call_key.c, guards/tensor_meta.cpp):
plain tensors and parameters are described from the C++ tensor, everything else
through Python. Either way a call hits only when dtype, device, shape, strides,
requires_grad, the tensor type and aliasing are what the graph was captured with;
each case runs against eager."""
import pytest
import torch
import torch.nn as nn

import nnscaler


def _f(x, y):
    return x * 2 + y


def _variants():
    base = torch.arange(24.0).reshape(4, 6)
    return {
        "contiguous": base.clone(),
        "transposed": base.clone().t(),
        "expanded": torch.arange(6.0).expand(4, 6),
        "sliced": torch.arange(48.0).reshape(4, 12)[:, ::2],
        "offset-view": torch.arange(30.0)[6:].reshape(4, 6),
        "float64": base.double(),
        "bfloat16": base.bfloat16(),
        "int64": base.long(),
        "requires-grad": base.clone().requires_grad_(),
        "parameter": nn.Parameter(base.clone()),
        "zero-dim": torch.tensor(3.0),
        "empty": torch.empty(0, 6),
        "channels-last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "17-dims": torch.ones([1] * 16 + [2]),
    }


def test_every_tensor_variant_gets_its_own_entry_and_eager_results():
    variants = _variants()
    g = nnscaler.compile(_f, cache_size_limit=len(variants))
    for _ in range(2):
        for name, x in variants.items():
            y = torch.ones((), dtype=x.dtype)
            got, want = g(x, y), _f(x, y)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert got.stride() == want.stride() or not got.is_contiguous(), name
            torch.testing.assert_close(got, want, msg=name)
            assert got.requires_grad == want.requires_grad, name
    info = nnscaler.cache_info(g)
    # "offset-view" has "contiguous"'s dtype, shape and strides: a storage offset is
    # not something a graph is specialised on, so it shares that entry.
    assert info.captures == len(variants) - 1
    assert info.hits == len(variants) + 1


def test_same_shape_other_strides_is_a_miss():
    g = nnscaler.compile(lambda x: x.view(-1) if x.is_contiguous() else x.reshape(-1) + 1)
    a = torch.randn(3, 4)
    b = torch.randn(4, 3).t()   # same shape (3, 4), other strides
    assert torch.equal(g(a), a.view(-1))
    assert torch.equal(g(b), b.reshape(-1) + 1)
    assert torch.equal(g(a), a.view(-1))
    assert nnscaler.cache_info(g).captures == 2


def test_tensor_and_parameter_are_distinct_keys():
    g = nnscaler.compile(lambda x: x + 1)
    t = torch.zeros(2)
    p = nn.Parameter(torch.zeros(2))
    g(t)
    g(p)
    g(t)
    assert nnscaler.cache_info(g).captures == 2


class ShapeLies(torch.Tensor):
    """A subclass whose Python attributes are what the key must read."""

    @property
    def shape(self):
        return torch.Size([99])


def test_tensor_subclass_is_read_through_python():
    g = nnscaler.compile(lambda x: x * 3)
    a = torch.ones(2).as_subclass(ShapeLies)
    b = torch.ones(5).as_subclass(ShapeLies)
    assert torch.equal(g(a).as_subclass(torch.Tensor), torch.full((2,), 3.0))
    # Same Python-visible shape (99,): the key cannot tell them apart by shape, but
    # strides differ, so the call still misses and gives eager's answer.
    assert torch.equal(g(b).as_subclass(torch.Tensor), torch.full((5,), 3.0))


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 4).to_sparse(),
    lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
], ids=["sparse", "nested"])
def test_non_strided_tensors_are_handled_without_crashing(make):
    g = nnscaler.compile(lambda x: x * 2)
    x = make()
    for _ in range(2):
        try:
            want = x * 2
        except Exception:
            pytest.skip("this layout does not support the op in eager either")
        got = g(x)
        if x.is_nested:
            for a, b in zip(got.unbind(), want.unbind()):
                torch.testing.assert_close(a, b)
        else:
            torch.testing.assert_close(got.to_dense(), want.to_dense())


def test_requires_grad_flip_on_the_same_tensor_is_a_miss():
    g = nnscaler.compile(lambda x: x.sin())
    x = torch.randn(3)
    assert not g(x).requires_grad
    x.requires_grad_()
    out = g(x)
    assert out.requires_grad
    out.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos())
    x.requires_grad_(False)
    assert not g(x).requires_grad
    assert nnscaler.cache_info(g).captures == 2


def test_resize_in_place_between_calls_is_a_miss():
    g = nnscaler.compile(lambda x: x.sum(0))
    x = torch.ones(2, 3)
    torch.testing.assert_close(g(x), torch.full((3,), 2.0))
    x.resize_(4, 3).fill_(1.0)
    torch.testing.assert_close(g(x), torch.full((3,), 4.0))
