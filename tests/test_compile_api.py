"""nnscaler.compile(): what it accepts, and clear errors for what it does not."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import nnscaler
from nnscaler_eval import _C


def test_module_is_compiled_in_place_and_state_dict_unchanged():
    m = torch.nn.Linear(2, 2)
    keys = list(m.state_dict())
    assert nnscaler.compile(m) is m
    assert list(m.state_dict()) == keys
    assert isinstance(m._compiled_call_impl, _C.ModuleCall)


def test_bare_and_with_arguments():
    @nnscaler.compile
    def f(x):
        return x + 1

    @nnscaler.compile(cache_size_limit=2)
    def g(x):
        return x + 2

    assert f.__name__ == "f" and f.__wrapped__ is not None
    assert g.config.cache_size_limit == 2


def test_class_decorator_compiles_every_instance():
    @nnscaler.compile
    class M(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.lin = torch.nn.Linear(n, n)

        def forward(self, x):
            return self.lin(x)

    a, b = M(2), M(3)
    assert isinstance(a._compiled_call_impl, _C.ModuleCall)
    assert isinstance(b._compiled_call_impl, _C.ModuleCall)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(cache_size_limit=0), ValueError, "cache_size_limit must be an int >= 1"),
        (dict(cache_size_limit="8"), ValueError, "cache_size_limit"),
        (dict(fullgraph="yes"), TypeError, "fullgraph must be a bool"),
        (dict(backend="no-such-backend"), ValueError, "unknown backend 'no-such-backend'"),
        (dict(backend=42), TypeError, "backend must be a name or a callable"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        nnscaler.compile(torch.nn.Linear(1, 1), **kwargs)


@pytest.mark.parametrize("obj", [42, "x", len, int])
def test_bad_objects(obj):
    with pytest.raises(TypeError, match="nnscaler.compile"):
        nnscaler.compile(obj)


def test_copies_are_plain_modules_as_with_torch_compile():
    # nn.Module.__getstate__ drops _compiled_call_impl (torch.compile's copies behave
    # the same): a copy runs eagerly until compiled again.
    m = nnscaler.compile(torch.nn.Linear(2, 2), cache_size_limit=3)
    x = torch.randn(1, 2)
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert c._compiled_call_impl is None
        torch.testing.assert_close(c(x), m(x))
        assert nnscaler.compile(c) is c
