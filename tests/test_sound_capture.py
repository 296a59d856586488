"""A cache hit never returns what eager would not: state read by a capture is guarded.

Each test compiles a module or function, calls it, changes something the forward read
(an attribute, a torch layer's setting, a global, a closure cell, an argument object's
attribute, global torch state, aliasing of inputs, ...) and checks the next compiled
call against eager on the same module and inputs.
"""
import copy
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler

SCALE = 2.0
GLOBAL_TENSOR = torch.ones(4)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a, b, atol=1e-6)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def check(compiled, eager_fn, *args):
    got = compiled(*args)
    want = eager_fn(*args)
    assert _same(got, want), (got, want)
    return got


def eager(module):
    """The same module run eagerly (no compiled call path)."""
    return lambda *args: module._call_impl(*args)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 0.5
        self.use_bias = True
        self.repeats = 1
        self.weights = [1.0, 2.0]
        self.table = {"a": 1.0}

    def forward(self, x):
        y = self.lin(x) * self.scale
        if self.use_bias:
            y = y + 1
        for _ in range(self.repeats):
            y = y * self.weights[1] + self.table["a"]
        return y


@pytest.mark.parametrize("change", [
    lambda m: setattr(m, "scale", 3.0),
    lambda m: setattr(m, "use_bias", False),
    lambda m: setattr(m, "repeats", 3),
    lambda m: m.weights.__setitem__(1, 5.0),
    lambda m: m.weights.append(7.0) or m.weights.__setitem__(1, -1.0),
    lambda m: m.table.__setitem__("a", -2.0),
    lambda m: setattr(m, "weights", [1.0, 9.0]),
], ids=["float", "bool", "int", "list-item", "list-append", "dict-value", "list-rebind"])
def test_attribute_changes_recapture(change):
    m = Scaled()
    compiled = nnscaler.compile(copy.deepcopy(m))
    x = torch.randn(2, 4)
    check(compiled, eager(compiled), x)
    change(compiled)
    check(compiled, eager(compiled), x)
    assert nnscaler.cache_info(compiled).captures == 2


def test_unrelated_writes_do_not_recapture():
    m = nnscaler.compile(Scaled())
    x = torch.randn(2, 4)
    m(x)
    for i in range(5):
        m.counter = i            # a name the forward never reads
        m.train(i % 2 == 0)      # toggles: the flag is an input or guarded by value
        check(m, eager(m), x)
    assert nnscaler.cache_info(m).captures == 1


@pytest.mark.parametrize("make, change", [
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)), lambda m: setattr(m[1], "p", 1.0)),
    (lambda: nn.LayerNorm(4), lambda m: setattr(m, "eps", 10.0)),
    (lambda: nn.LeakyReLU(0.01), lambda m: setattr(m, "negative_slope", 0.5)),
    (lambda: nn.Softmax(dim=0), lambda m: setattr(m, "dim", 1)),
], ids=["dropout-p", "layernorm-eps", "leakyrelu-slope", "softmax-dim"])
def test_torch_layer_settings(make, change):
    m = nnscaler.compile(make())
    m.train()
    x = torch.randn(3, 4)
    torch.manual_seed(0)
    check(m, eager(m), x)
    change(m)
    torch.manual_seed(0)
    got = m(x)
    torch.manual_seed(0)
    assert _same(got, m._call_impl(x))


class UsesGlobal(nn.Module):
    def forward(self, x):
        return x * SCALE


def test_module_global_rebinding():
    global SCALE
    m = nnscaler.compile(UsesGlobal())
    x = torch.randn(3)
    check(m, eager(m), x)
    old = SCALE
    try:
        SCALE = 5.0
        check(m, eager(m), x)
    finally:
        SCALE = old


def test_closure_cell_and_class_attribute():
    factor = 2.0

    class Closure(nn.Module):
        offset = 1.0

        def forward(self, x):
            return x * factor + self.offset

    m = nnscaler.compile(Closure())
    x = torch.randn(3)
    check(m, eager(m), x)
    factor = 4.0
    check(m, eager(m), x)
    Closure.offset = -3.0
    check(m, eager(m), x)


def test_compiled_function_closure_cell():
    k = 2.0

    def f(x):
        return x * k

    g = nnscaler.compile(f)
    x = torch.randn(3)
    assert torch.equal(g(x), f(x))
    k = 3.0
    assert torch.equal(g(x), x * 3.0)


class Config:
    def __init__(self):
        self.scale = 2.0
        self.inner = types.SimpleNamespace(shift=1.0)


class UsesConfig(nn.Module):
    def forward(self, x, cfg):
        return x * cfg.scale + cfg.inner.shift


def test_argument_object_attributes():
    m = nnscaler.compile(UsesConfig())
    cfg = Config()
    x = torch.randn(3)
    check(m, eager(m), x, cfg)
    cfg.scale = 7.0
    check(m, eager(m), x, cfg)
    cfg.inner.shift = -1.0
    check(m, eager(m), x, cfg)


class AutocastAware(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.dtype == torch.bfloat16:
            return y.float() * 2
        return y


def test_autocast_and_default_dtype():
    m = nnscaler.compile(AutocastAware())
    x = torch.randn(2, 4)
    check(m, eager(m), x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m(x)
        want = m._call_impl(x)
    assert _same(got, want)
    check(m, eager(m), x)

    def make(x):
        return torch.ones(2) + x

    f = nnscaler.compile(make)
    a = torch.zeros(2, dtype=torch.float64)
    f(a)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert f(a).dtype == make(a).dtype
        assert nnscaler.cache_info(f).captures == 2
    finally:
        torch.set_default_dtype(old)


class TwoInputs(nn.Module):
    def forward(self, a, b):
        return a * 2 + b


def test_aliased_inputs_both_ways():
    m = nnscaler.compile(TwoInputs())
    x, a, b = torch.randn(3), torch.randn(3), torch.randn(3)
    check(m, eager(m), x, x)
    check(m, eager(m), a, b)
    m2 = nnscaler.compile(TwoInputs())
    check(m2, eager(m2), a, b)
    check(m2, eager(m2), x, x)


class ReadsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.arange(4.0))

    def forward(self, x):
        return x + self.buf * 10 + GLOBAL_TENSOR


@pytest.mark.parametrize("first", ["buffer", "global"])
def test_state_tensor_passed_as_input(first):
    m = nnscaler.compile(ReadsBuffer())
    state = m.buf if first == "buffer" else GLOBAL_TENSOR
    check(m, eager(m), state)
    check(m, eager(m), torch.randn(4))
    check(m, eager(m), state)


class Appends(nn.Module):
    def forward(self, x, seen, info):
        seen.append(x.sum())
        info["last"] = x * 2
        return x + 1


def test_argument_container_side_effects_happen_every_call():
    m = nnscaler.compile(Appends())
    for i in range(3):
        seen, info = [], {}          # the same key every call
        x = torch.full((2,), float(i))
        out = m(x, seen, info)
        assert torch.equal(out, x + 1)
        assert len(seen) == 1 and torch.equal(seen[0], x.sum())
        assert torch.equal(info["last"], x * 2)


class CastsToWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x.to(self.lin.weight.dtype))


def test_module_to_bfloat16_in_place():
    m = nnscaler.compile(CastsToWeight())
    x = torch.randn(2, 4)
    check(m, eager(m), x)
    m.to(torch.bfloat16)
    check(m, eager(m), x)


def test_size_and_numpy_scalars_keyed_by_value():
    def f(x, size, k):
        return x.reshape(size) * float(k)

    g = nnscaler.compile(f)
    x = torch.randn(6)
    for _ in range(3):
        assert torch.equal(g(x, torch.Size([2, 3]), np.float64(2.0)), f(x, torch.Size([2, 3]), 2.0))
        assert torch.equal(g(x, torch.Size([3, 2]), np.float32(1.5)), f(x, torch.Size([3, 2]), 1.5))
    assert nnscaler.cache_info(g).captures == 2


def test_global_state_change_is_logged(caplog):
    import logging
    from nnscaler_eval import logs
    m = nnscaler.compile(Scaled())
    x = torch.randn(2, 4)
    m(x)
    logging.getLogger("nnscaler.recaptures").setLevel(logging.DEBUG)
    try:
        with caplog.at_level(logging.DEBUG, logger="nnscaler.recaptures"):
            m.scale = 9.0
            m(x)
    finally:
        logging.getLogger("nnscaler.recaptures").setLevel(logging.WARNING)
    text = caplog.text
    assert "recapture" in text and "scale" in text, text
    del logs


class Holder:
    def __init__(self, module):
        self.module = module
        self.scale = 2.0


def test_argument_object_referencing_the_module_is_not_kept_alive():
    """Identity-keyed arguments are held by weakref, and guarded __dict__s through
    their owner's weakref: nothing in the cache keeps the module alive."""
    import gc
    import weakref
    m = nnscaler.compile(UsesConfig())
    x = torch.randn(3)
    holder = Config()
    holder.module = m          # the argument object references the module
    m(x, holder)
    m(x, holder)
    del holder
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


class _MeddlingKey:
    """A dict key whose __eq__ runs Python that rewrites the dict being re-validated."""

    def __init__(self, table):
        self.table = table

    def __hash__(self):
        return 7

    def __eq__(self, other):
        if isinstance(other, _MeddlingKey) and other is not self:
            self.table.clear()     # frees what a borrowed walk would still hold
            self.table[self] = 5.0
        return other is self


def test_python_inside_value_guard_revalidation():
    class UsesTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = {}
            self.table[_MeddlingKey(self.table)] = 2.0

        def forward(self, x):
            return x * sum(self.table.values())

    m = nnscaler.compile(UsesTable())
    x = torch.randn(3)
    check(m, eager(m), x)
    m.table[_MeddlingKey(m.table)] = 3.0   # version moves; re-validation runs __eq__
    m(x)   # the guard's re-validation rewrites the dict it is reading: no crash
    for _ in range(3):   # the state has settled: hits equal eager
        check(m, eager(m), x)


def test_guard_specs_are_not_modified():
    from nnscaler_eval import _C
    from nnscaler_eval.state_guards import MISSING, VG_DICT, VG_LIST
    target = types.SimpleNamespace()
    d, lst = {"a": target}, [target]
    values, items = (target,), (target,)
    _C.CacheEntry(None, [], [], [], ["d", "l"], None,
                  [(VG_DICT, d, ("a",), values, MISSING), (VG_LIST, lst, items)])
    assert values[0] is target and items[0] is target
