"""A cache hit never returns what eager would not: state read by a capture is guarded.

Each test compiles a module or function, calls it, changes something the forward read
(an attribute, a torch layer's setting, a global, a closure cell, an argument object's
attribute, global torch state, aliasing of inputs, ...) and checks the next compiled
call against eager on the same module and inputs.
"""
import copy
import os
import random
import sys
import time
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import nnscaler
from nnscaler_eval.tools.explain import _buckets
from nnscaler_eval.capture import GraphBreakError
from models import meddling_training
from oracle import assert_same, same

SCALE = 2.0
GLOBAL_TENSOR = torch.ones(4)


def check(compiled, eager_fn, *args):
    got = compiled(*args)
    want = eager_fn(*args)
    assert_same(got, want, atol=1e-6)
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
    assert same(got, m._call_impl(x), atol=1e-6)


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
    assert same(got, want, atol=1e-6)
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
    """A dict key whose __eq__ runs Python that rewrites the dict being looked up, once
    per key (every time would make CPython's own lookup restart forever when the
    rewritten dict does not get its old keys object back, as under PYTHONMALLOC=malloc)."""

    def __init__(self, table):
        self.table = table
        self.meddled = False

    def __hash__(self):
        return 7

    def __eq__(self, other):
        if isinstance(other, _MeddlingKey) and other is not self and not self.meddled:
            self.meddled = True
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
    from nnscaler_eval.guarding.state_guards import MISSING, VG_DICT, VG_LIST
    target = types.SimpleNamespace()
    d, lst = {"a": target}, [target]
    values, items = (target,), (target,)
    _C.CacheEntry(None, [], [], ["d", "l"], None,
                  [(VG_DICT, d, ("a",), values, MISSING), (VG_LIST, lst, items)])
    assert values[0] is target and items[0] is target


class KVStore:
    """Not a pytree container: holds tensors the forward reads and grows in place
    (the shape of an HF DynamicCache)."""

    def __init__(self):
        self.keys = None


class AttendsToStore(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4)

    def forward(self, x, store):
        k = self.proj(x)
        store.keys = k if store.keys is None else torch.cat([store.keys, k])
        return self.inner(x) + store.keys.sum(0)


def _run_steps(m, stores, steps, seed):
    torch.manual_seed(seed)
    outs = []
    for store in stores:
        for _ in range(steps):
            outs.append(m(torch.randn(1, 4), store))
    return outs


def test_argument_type_that_falls_back_costs_no_entry_per_object():
    # A new store per sequence and a new shape per step: after the first sequence the
    # forward runs eagerly at once for this type (no key, no entry, no miss), while
    # its submodules still hit; results equal eager's, store contents included.
    base = AttendsToStore()
    ref = copy.deepcopy(base)
    m = nnscaler.compile(base)
    got_stores, want_stores = [KVStore() for _ in range(4)], [KVStore() for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no cache_size_limit warning either
        got = _run_steps(m, got_stores, 5, 0)
    want = _run_steps(ref, want_stores, 5, 0)
    assert_same(got + [s.keys for s in got_stores], want + [s.keys for s in want_stores],
                atol=1e-6)
    root = [b for b in _buckets(m) if b.self is m][0]
    assert [t for t, _ in root.eager_types] == [KVStore]
    assert "KVStore" in root.eager_types[0][1] and __file__ in root.eager_types[0][1]
    # every call ran eagerly: the first through its trace, which fell back
    assert root.misses == 1 and len(root.entries) == 0 and root.fallbacks == 20
    inner = nnscaler.cache_info(m.inner)
    assert inner.captures == 1 and inner.hits >= 18


def test_argument_type_fallback_is_found_inside_kwargs_and_lists():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = AttendsToStore()

        def forward(self, x, **kwargs):
            return self.body(x, kwargs["stores"][0])

    base = Wrapped()
    ref = copy.deepcopy(base)
    m = nnscaler.compile(base)
    stores_got, stores_want = [KVStore()], [KVStore()]
    torch.manual_seed(0)
    xs = [torch.randn(1, 4) for _ in range(6)]
    for x in xs:
        torch.testing.assert_close(m(x, stores=[stores_got[0]]), ref(x, stores=[stores_want[0]]))
    torch.testing.assert_close(stores_got[0].keys, stores_want[0].keys)
    root = [b for b in _buckets(m) if b.self is m][0]
    assert [t for t, _ in root.eager_types] == [KVStore]
    assert root.misses == 1


def test_argument_type_fallback_keeps_fullgraph_an_error():
    m = nnscaler.compile(AttendsToStore(), fullgraph=True)
    for _ in range(2):
        with pytest.raises(GraphBreakError, match="KVStore"):
            m(torch.randn(1, 4), KVStore())


def test_bucket_eager_types_rejects_bad_values():
    base = AttendsToStore()
    ref = copy.deepcopy(base)
    m = nnscaler.compile(base)
    m(torch.randn(1, 4), KVStore())
    root = [b for b in _buckets(m) if b.self is m][0]
    before = root.eager_types
    for bad in ([(KVStore, "r")], ((KVStore,),), ((1, "r"),), ((KVStore, 2),)):
        with pytest.raises(TypeError, match="eager_types"):
            root.eager_types = bad
    assert root.eager_types == before
    root.eager_types = ()
    assert root.eager_types == ()
    torch.testing.assert_close(m(torch.ones(1, 4), KVStore()), ref(torch.ones(1, 4), KVStore()))


@pytest.mark.parametrize("draw", [
    lambda: random.random(),
    lambda: random.randint(0, 10 ** 9),
    lambda: float(np.random.rand()),
    lambda: time.perf_counter() % 1.0,
    lambda: time.time_ns() % 1000,
    lambda: os.urandom(4)[0],
], ids=["random.random", "random.randint", "numpy.random", "time.perf_counter",
        "time.time_ns", "os.urandom"])
def test_impure_python_values_are_never_baked_in(draw):
    # Eager sees a new value every call; a graph holding the capture's value would
    # repeat it. Such a forward runs eagerly, with the reason recorded.
    class Draws(nn.Module):
        def forward(self, x):
            return x + draw()

    m = nnscaler.compile(Draws())
    values = set()
    for _ in range(4):
        values.add(m(torch.zeros(1)).item())
        time.sleep(0.001)
    assert len(values) > 1
    info = nnscaler.cache_info(m)
    assert info.captures == 0 and info.fallbacks >= 3


def test_clock_read_by_logging_does_not_stop_the_capture(caplog):
    import logging
    log = logging.getLogger("test_sound_capture.clock")

    class Logs(nn.Module):
        def forward(self, x):
            log.warning("forward")   # a LogRecord reads the clock (time.time/time_ns)
            return x * 2

    m = nnscaler.compile(Logs())
    with caplog.at_level(logging.WARNING):
        assert torch.equal(m(torch.ones(2)), torch.full((2,), 2.0))
    assert nnscaler.cache_info(m).captures == 1


def test_replaced_instance_dict_is_seen_even_while_the_old_one_lives():
    # `obj.__dict__ = ...` changes no watched dict (the old one is kept alive here):
    # the guard compares the owner's current __dict__ by identity on every check.
    m = nnscaler.compile(Scaled())
    ref = copy.deepcopy(m)
    x = torch.randn(2, 4)
    check(m, eager(ref), x)
    check(m, eager(ref), x)
    old = m.__dict__
    m.__dict__ = dict(old, scale=3.0)
    ref.scale = 3.0
    check(m, eager(ref), x)
    assert old["scale"] == 0.5


class _Mode(nn.Module):
    """A submodule whose output depends on its own training flag."""

    def forward(self, x):
        return x * 2 if self.training else x * 3


class _HoldsMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Mode()

    def forward(self, x):
        return self.inner(x) + 1


def _hits_twice(m, ref, x):
    check(m, eager(ref), x)
    check(m, eager(ref), x)   # a hit: on 3.12+ the dict clock vouches for the flags


def test_training_flag_written_into_the_instance_dict_is_seen():
    # No setattr, no Module.train(): the flag's dict itself is written.
    m = nnscaler.compile(_HoldsMode())
    ref = copy.deepcopy(m)
    x = torch.randn(3)
    _hits_twice(m, ref, x)
    m.inner.__dict__["training"] = False
    ref.inner.__dict__["training"] = False
    _hits_twice(m, ref, x)
    m.inner.__dict__.update(training=True)
    ref.inner.__dict__.update(training=True)
    _hits_twice(m, ref, x)


def test_training_flag_in_a_replaced_instance_dict_is_seen_while_the_old_one_lives():
    # The old dict stays alive and unchanged, so no dict event: the flag's module must
    # be seen reading another dict.
    m = nnscaler.compile(_HoldsMode())
    ref = copy.deepcopy(m)
    x = torch.randn(3)
    _hits_twice(m, ref, x)
    old = m.inner.__dict__
    m.inner.__dict__ = dict(old, training=False)
    ref.inner.training = False
    _hits_twice(m, ref, x)
    assert old["training"] is True
    m.inner.__dict__ = old
    ref.inner.training = True
    _hits_twice(m, ref, x)


@pytest.mark.parametrize("where", ["class", "base"])
def test_training_property_added_after_hits_is_honoured(where):
    # The instance dict is unchanged; only the class (or a base class after the one
    # that defines forward) now answers `training`, through a property.
    class Mixin:
        pass

    class Mode(_Mode, Mixin):
        pass

    class Holds(_HoldsMode):
        def __init__(self):
            super().__init__()
            self.inner = Mode()

    owner = Mode if where == "class" else Mixin
    m = nnscaler.compile(Holds())
    x = torch.randn(3)
    check(m, lambda x: x * 2 + 1, x)
    check(m, lambda x: x * 2 + 1, x)
    owner.training = property(lambda self: False, lambda self, value: None)
    check(m, lambda x: x * 3 + 1, x)
    check(m, lambda x: x * 3 + 1, x)
    del owner.training
    check(m, lambda x: x * 2 + 1, x)


class _BranchMode(nn.Module):
    """The same answers as _Mode, from a branch: a flag guard, not a graph input."""

    def forward(self, x):
        if self.training:
            return x * 2
        return x * 3


_KEPT: list = []


def _flag_change(change, inner):
    base = type(inner).__mro__[1]
    if change == "class with a property":
        inner.__class__ = type("AnswersTrue", (base,), {
            "training": property(lambda self: True, lambda self, value: None)})
    elif change == "class without one":
        inner.__class__ = type("SameAnswer", (base,), {})
        inner.__dict__["training"] = False
    elif change == "value moved to the class":
        type(inner).training = False           # not read while the instance has one
        del inner.__dict__["training"]         # now it is
    elif change == "dict replaced, old kept":
        _KEPT.append(inner.__dict__)           # alive and unchanged: no dict event
        inner.__dict__ = dict(inner.__dict__, training=False)
    elif change == "flag written through object.__setattr__":
        object.__setattr__(inner, "training", False)
    elif change == "flag toggled and back, then written":
        inner.training = False
        inner.training = True
        inner.__dict__["training"] = False


FLAG_CHANGES = ["class with a property", "class without one", "value moved to the class",
                "dict replaced, old kept", "flag written through object.__setattr__",
                "flag toggled and back, then written"]


@pytest.mark.parametrize("change", FLAG_CHANGES)
@pytest.mark.parametrize("kind", [_Mode, _BranchMode], ids=["graph input", "branched on"])
def test_a_flag_is_read_again_when_its_source_changes(change, kind):
    """Training flags (a graph input, or a branch's guard) are read once and then
    remembered while the module's class, __dict__ and that dict's version (3.11) or
    the dict clock (3.12+) stand (cache_entry.h, FlagRead): every way the flag can change
    after hits must give eager's answer, whether the class, the instance dict, or
    where `training` comes from changed."""
    Mode = type("Mode", (kind,), {})

    class Holds(_HoldsMode):
        def __init__(self):
            super().__init__()
            self.inner = Mode()

    m = nnscaler.compile(Holds())
    ref = copy.deepcopy(m)
    x = torch.randn(3)
    for _ in range(3):
        _hits_twice(m, ref, x)
    _flag_change(change, m.inner)
    _flag_change(change, ref.inner)
    assert m.inner.training is ref.inner.training
    for _ in range(2):
        _hits_twice(m, ref, x)
    if change != "value moved to the class":
        m.inner.training = not m.inner.training   # and once more, through setattr
        ref.inner.training = not ref.inner.training
        _hits_twice(m, ref, x)


def test_a_flag_module_that_dies_is_never_vouched_for():
    # The entry holds the flag's module weakly; once it dies (its parent dropped it
    # and replaced it), a hit must not take the old decision for the new module.
    m = nnscaler.compile(_HoldsMode())
    x = torch.randn(3)
    check(m, lambda x: x * 2 + 1, x)
    check(m, lambda x: x * 2 + 1, x)
    fresh = _Mode()
    fresh.training = False
    m.inner = fresh   # the old submodule is freed here
    check(m, lambda x: x * 3 + 1, x)
    check(m, lambda x: x * 3 + 1, x)


def _scaled_entry():
    m = nnscaler.compile(Scaled())
    x = torch.randn(2, 4)
    m(x)
    m(x)
    return m, x, [b for b in _buckets(m) if b.self is m][0].entries[0]


@pytest.mark.skipif(sys.version_info < (3, 12), reason="3.11 has no dict watchers: no clock")
def test_unchanged_dicts_are_vouched_for_by_one_clock_on_3_12_plus():
    from nnscaler_eval import _C
    m, x, entry = _scaled_entry()
    assert entry.clean_clock == _C.dict_clock() != 0
    m.table["a"] = 5.0                  # a watched dict changes: the clock moves
    assert _C.dict_clock() != entry.clean_clock
    ref = copy.deepcopy(m)
    check(m, eager(ref), x)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12+ vouch by the dict clock")
def test_every_dict_is_checked_on_every_hit_on_3_11():
    from nnscaler_eval import _C
    m, x, entry = _scaled_entry()
    assert _C.dict_clock() == 0 and entry.clean_clock == 0
    m.table["a"] = 5.0                  # seen by the dict's own version
    ref = copy.deepcopy(m)
    check(m, eager(ref), x)


class _ResetsOnDel:
    """An argument object whose finalizer resets every cache (Python run while C
    holds the bucket on the eager-type path)."""

    def __init__(self):
        self.keys = torch.ones(1)   # tensors outside a pytree container: eager type

    def __del__(self):
        nnscaler.reset()


def test_eager_type_path_survives_reset_and_finalizers_mid_call():
    class Drops(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x, store):
            nnscaler.reset()                  # the bucket C holds is dropped meanwhile
            store.keys = store.keys + 1
            return self.inner(x) + store.keys

    base = Drops()
    ref = copy.deepcopy(base)
    m = nnscaler.compile(base)
    torch.manual_seed(0)
    for _ in range(4):
        x = torch.randn(2, 4)
        got = m(x, _ResetsOnDel())        # the store dies (and resets) after the call
        want = ref(x, _ResetsOnDel())
        torch.testing.assert_close(got, want)


def test_generated_code_belongs_to_the_module_that_generated_it():
    # Dataclass / namedtuple methods are compiled from strings (filename "<string>"):
    # ours and torch's are library code (no guards on them); the user's stay the
    # user's, and so does code exec'd with globals of its own.
    import collections
    import dataclasses

    from nnscaler_eval.guarding import state_guards
    from nnscaler_eval.capture import Capture

    @dataclasses.dataclass
    class Point:
        x: float = 0.0

    UserPair = collections.namedtuple("UserPair", "a b")
    scope: dict = {}
    exec("def made(): return 1", scope)
    library = state_guards._is_library_function
    assert Capture.__init__.__code__.co_filename.startswith("<")
    assert library(Capture.__init__)
    assert not library(Point.__init__)
    assert not library(UserPair.__new__)
    assert not library(scope["made"])
    assert library(torch.nn.functional.dropout)


def test_no_state_guard_reads_our_own_code():
    m = nnscaler.compile(Scaled())
    x = torch.randn(2, 4)
    m(x)
    names = [n for b in _buckets(m) for e in b.entries for n in e.guard_names]
    assert names and not [n for n in names if "nnscaler_eval" in n or "Capture." in n
                          or "RunnerSpec" in n], names


@pytest.mark.parametrize("kind", [_Mode, _BranchMode], ids=["graph input", "branched on"])
def test_a_training_property_that_resets_and_detaches_its_module_during_a_hit(kind):
    # Python in the middle of a flag's read (cache_flag: the guards' flags, or the
    # runner's, read through the property): it retires every cache entry, drops the
    # module whose flag is being read from its parent and collects it.  Nothing may
    # crash, the call returns what one of the two module trees computes, and later
    # calls are eager's.
    import gc

    class Sneaky(kind):   # the kind's forward, reading the flag through this property
        armed = False

        @property
        def training(self):
            if Sneaky.armed:
                Sneaky.armed = False
                nnscaler.reset()
                holder.inner = _Mode()
                gc.collect()
            return self.__dict__.get("_mode", True)

        @training.setter
        def training(self, value):
            self.__dict__["_mode"] = value

    holder = _HoldsMode()
    holder.inner = Sneaky()
    m = nnscaler.compile(holder)
    x = torch.randn(3)
    check(m, lambda x: x * 2 + 1, x)
    check(m, lambda x: x * 2 + 1, x)
    Sneaky.armed = True
    check(m, lambda x: x * 2 + 1, x)
    assert isinstance(holder.inner, _Mode) and not isinstance(holder.inner, Sneaky)
    holder.inner.training = False
    check(m, lambda x: x * 3 + 1, x)
    check(m, lambda x: x * 3 + 1, x)


class _Sibling(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("kind", [_Mode, _BranchMode], ids=["graph input", "branched on"])
def test_a_flag_read_that_replaces_a_sibling_module_mid_hit(kind):
    # Python in the middle of a flag's read (the flag is an object whose __bool__ runs
    # Python: a flag guard's read, or the runner's) replaces another module the entry
    # checks (a held owner, cache_entry.h: read through a borrowed pointer while the dicts
    # are unchanged) and collects the old one.  On 3.12+ the dict clock moved during
    # the check: nothing may be vouched for by the clock read before it, and the old
    # sibling must not be read through its pointer (under ASan: a use after free).
    # The call returns what either tree computes (eager loads `self.sib` before the
    # flag is read; the guards read the flag first); the next call is eager's.
    import gc
    from nnscaler_eval import _C

    class Truthy:
        armed = False

        def __bool__(self):
            if Truthy.armed:
                Truthy.armed = False
                holder._modules["sib"] = _Sibling()
                gc.collect()
            return True

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.flagged = kind()
            self.sib = _Sibling()

        def forward(self, x):
            return self.sib(self.flagged(x))

    holder = Holder()
    holder.flagged.__dict__["training"] = Truthy()
    m = nnscaler.compile(holder)
    x = torch.randn(2, 3)
    with torch.no_grad():
        for _ in range(3):
            check(m, eager(holder), x)
        entries = [e for b in _C.code_state(Holder.forward.__code__)["buckets"]
                   if b.self is holder for e in b.entries]
        assert entries and entries[0].n_held_owners >= 2   # the path this test is for
        old_answer = eager(holder)(x)
        m(x)   # hits with nothing between: on 3.12+ the clock vouches for the dicts
        m(x)
        Truthy.armed = True
        got = m(x)
        assert not Truthy.armed
        new_answer = eager(holder)(x)
        assert same(got, old_answer, atol=1e-6) or same(got, new_answer, atol=1e-6)
        check(m, eager(holder), x)


def test_a_property_read_by_a_frameless_hit_that_uncompiles_and_rewrites_the_module():
    # A positional call is answered without the forward's frame (compiled_call.c,
    # call_forward).  Python in the middle of it (the root's own `training`, read by
    # the guards) removes the compiled call from the module, swaps the class's
    # forward and collects: the call finishes with what the graph or eager computes,
    # nothing crashes, and the module then runs the new forward eagerly.
    import gc

    def uncompile_and_rewrite(module):
        if Root.armed:
            Root.armed = False
            module.__dict__.pop("_compiled_call_impl", None)
            Root.forward = lambda self, x: x - 100
            gc.collect()

    class Root(nn.Module):
        armed = False
        training = meddling_training(uncompile_and_rewrite)

        def forward(self, x):
            return x * 2 if self.training else x * 3

    m = nnscaler.compile(Root())
    x = torch.randn(3)
    check(m, lambda x: x * 2, x)
    check(m, lambda x: x * 2, x)
    Root.armed = True
    got = m(x)
    assert same(got, x * 2, atol=1e-6) or same(got, x - 100, atol=1e-6), got
    check(m, lambda x: x - 100, x)
    check(m, lambda x: x - 100, x)


# ---- `obj.__class__ = Other` after hits: no dict moves, the code and the class
# attributes the capture read now come from another class.

class _Twice(nn.Module):
    factor = 2.0

    def forward(self, x):
        return x * self.factor


class _Thrice(nn.Module):
    def forward(self, x):
        return x * 3


class _TwiceByHelper(nn.Module):
    def helper(self, x):
        return x * 2

    def forward(self, x):
        return self.helper(x) + 1


class _TenfoldByHelper(_TwiceByHelper):
    """The same forward (same code object), another helper."""

    def helper(self, x):
        return x * 10


class _HoldsTwice(_HoldsMode):
    """_HoldsMode's forward around a _Twice."""

    def __init__(self):
        super().__init__()
        self.inner = _Twice()


class _Config:
    scale = 2.0


class _BigConfig:
    scale = 5.0


class _ReadsConfig(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = _Config()

    def forward(self, x):
        return x * self.cfg.scale


@pytest.mark.parametrize("case", ["submodule", "root same forward", "config object",
                                  "class attribute"])
def test_an_object_given_another_class_after_hits_is_seen(case):
    if case == "submodule":
        m, target, other = _HoldsTwice(), None, _Thrice
        target = m.inner
    elif case == "root same forward":
        m = _TwiceByHelper()
        target, other = m, _TenfoldByHelper
    elif case == "config object":
        m = _ReadsConfig()
        target, other = m.cfg, _BigConfig
    else:   # a subclass that only changes a class attribute the forward read
        m = _HoldsTwice()
        target, other = m.inner, type("_Fivefold", (_Twice,), {"factor": 5.0})
    compiled = nnscaler.compile(m)
    ref = copy.deepcopy(m)
    ref_target = {"submodule": lambda r: r.inner, "root same forward": lambda r: r,
                  "config object": lambda r: r.cfg, "class attribute": lambda r: r.inner}[case](ref)
    x = torch.randn(3)
    for _ in range(2):
        check(compiled, eager(ref), x)
    original = type(target)
    target.__class__ = other
    ref_target.__class__ = other
    for _ in range(2):
        check(compiled, eager(ref), x)
    target.__class__ = original   # and back: the first entry serves again
    ref_target.__class__ = original
    captures = nnscaler.cache_info(compiled).captures
    for _ in range(2):
        check(compiled, eager(ref), x)
    assert nnscaler.cache_info(compiled).captures == captures


# ---- `param.data = other`: no module dict moves, no Module._apply runs.

class _ReadsWeightShape(nn.Module):
    """Python reads a parameter's shape; the graph never uses the parameter."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x.reshape(self.w.shape[0], -1).sum(0)


class _CastsToWeightDtype(nn.Module):
    """HF's RMSNorm pattern: the input is cast to the weight's dtype."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.weight * x.to(self.weight.dtype)


@pytest.mark.parametrize("case", ["shape read only", "dtype of a used weight"])
def test_parameter_data_assigned_after_hits_is_seen(case):
    if case == "shape read only":
        m = _ReadsWeightShape()
        new = lambda p: torch.ones(2)                       # noqa: E731
        x = torch.arange(8.0)
    else:
        m = _CastsToWeightDtype()
        new = lambda p: p.detach().half() * 3              # noqa: E731
        x = torch.linspace(0.1, 1.3, 4)
    compiled = nnscaler.compile(m)
    ref = copy.deepcopy(m)
    for _ in range(2):
        check(compiled, eager(ref), x)
    param = next(m.parameters())
    ref_param = next(ref.parameters())
    param.data = new(param)
    ref_param.data = new(ref_param)
    for _ in range(2):
        check(compiled, eager(ref), x)
    assert isinstance(param, nn.Parameter) and param.requires_grad


def test_tensor_data_property_behaves_as_torchs():
    p = nn.Parameter(torch.ones(2))
    d = p.data
    assert type(d) is torch.Tensor and not d.requires_grad and d.data_ptr() == p.data_ptr()
    p.data = torch.zeros(3)
    assert isinstance(p, nn.Parameter) and p.requires_grad and p.shape == (3,)
    with pytest.raises(TypeError, match="has to be a tensor"):
        p.data = 3

    class Logged(torch.Tensor):
        seen: list = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.seen.append(getattr(func, "__name__", func))
            return super().__torch_function__(func, types, args, kwargs or {})

    t = torch.ones(2).as_subclass(Logged)
    assert torch.equal(t.data, torch.ones(2))
    assert Logged.seen   # the getter still dispatches to __torch_function__


def test_a_finalizer_a_collection_runs_during_the_trace_is_not_recorded():
    """Cyclic garbage whose finalizer bumps a counter tensor and leaves new garbage
    behind, with a collection forced on every allocation: before the fix a collection
    ran in the middle of the first call's trace, its `counter.add_(1)` was recorded,
    and every later call bumped the counter again.  No collection runs during a trace
    (Tracer.run): the finalizers run as written, outside it, and later calls (the
    chain stopped) leave the counter alone, as eager does."""
    import gc

    counter = torch.zeros(())
    chain = {"on": True}

    class Junk:
        def __init__(self):
            self.me = self

        def __del__(self):
            counter.add_(1)
            if chain["on"]:
                Junk()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x).relu() + 1
            return x

    eager = Net()
    compiled = nnscaler.compile(copy.deepcopy(eager))
    x = torch.randn(2, 4)
    threshold = gc.get_threshold()
    collecting = gc.isenabled()
    gc.enable()
    Junk()
    gc.set_threshold(1)
    try:
        got = compiled(x)
    finally:
        chain["on"] = False
        gc.set_threshold(*threshold)
    gc.collect()
    if not collecting:
        gc.disable()
    assert counter.item() > 0          # the finalizers ran
    assert gc.isenabled() == collecting
    settled = counter.item()
    for _ in range(3):
        assert_same(compiled(x), eager(x))
    assert counter.item() == settled
    assert_same(got, eager(x))
    info = nnscaler.cache_info(compiled)
    assert info.fallbacks == 0 and info.hits == 3, info
