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


# --------------------------------------------------------------------------------
# The key in words: _C.describe_call_key decodes the bytes the hit path compares
# (guards/call_key_reader.c), the only description of the key logs and explain() show.

import gc

from nnscaler_eval import _C
from nnscaler_eval.tools.explain import _buckets


class Foo:
    pass


class NoWeakref:
    """Not weakly referenceable: the stored key holds it strongly."""
    __slots__ = ()


class Plain(torch.Tensor):
    pass


def _entries(g):
    return [e for bucket in _buckets(g) for e in bucket.entries]


def _only_entry(g):
    entries = _entries(g)
    assert len(entries) == 1, entries
    return entries[0]


def _many(x, t, bf, i64, flag, zero, expanded, meta, p, sub, n, fl, b, s, none, size,
          npf, npi, npb, tup, lst, d, obj, strong, big, dev, same, *rest, **kw):
    return x + 1


def test_description_matches_the_arguments():
    np = pytest.importorskip("numpy")
    x = torch.zeros(2, 8)
    t = torch.zeros(3, 4, dtype=torch.float64).t()
    foo, strong, big = Foo(), NoWeakref(), 2 ** 70
    args = (x, t, torch.zeros(2, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.int64),
            torch.zeros(1, dtype=torch.bool), torch.tensor(3.0), torch.zeros(4).expand(3, 4),
            torch.empty(2, 3, device="meta"), nn.Parameter(torch.zeros(3)),
            torch.ones(2).as_subclass(ShapeLies), 3, 1.5, True, "hi", None,
            torch.Size([2, 3]), np.float64(2.0), np.int32(-7), np.bool_(True),
            (1, (2.5, "a")), [x, 2], {"k": t, 3: None}, foo, strong, big,
            torch.device("cpu"), x, "extra")
    g = nnscaler.compile(_many)
    g(*args, key=[1.0])
    entry = _only_entry(g)
    names = _many.__code__.co_varnames[:_many.__code__.co_argcount + 2]
    got = _C.describe_call_key(entry, names)
    assert list(got) == [
        "grad_mode: True",
        "x: Tensor(float32, cpu, shape=(2, 8), stride=(8, 1), requires_grad=False)",
        "t: Tensor(float64, cpu, shape=(4, 3), stride=(1, 4), requires_grad=False)",
        "bf: Tensor(bfloat16, cpu, shape=(2,), stride=(1,), requires_grad=False)",
        "i64: Tensor(int64, cpu, shape=(5,), stride=(1,), requires_grad=False)",
        "flag: Tensor(bool, cpu, shape=(1,), stride=(1,), requires_grad=False)",
        "zero: Tensor(float32, cpu, shape=(), stride=(), requires_grad=False)",
        "expanded: Tensor(float32, cpu, shape=(3, 4), stride=(0, 1), requires_grad=False)",
        "meta: Tensor(float32, meta, shape=(2, 3), stride=(3, 1), requires_grad=False)",
        "p: Parameter(float32, cpu, shape=(3,), stride=(1,), requires_grad=True)",
        # the Python-visible shape: what the key reads, and so what a hit compares
        "sub: ShapeLies(float32, cpu, shape=(99,), stride=(1,), requires_grad=False)",
        "n: 3",
        "fl: 1.5",
        "b: True",
        "s: 'hi'",
        "none: None",
        "size: Size(2, 3)",
        "npf: float64(2.0)",
        "npi: int32(-7)",
        "npb: bool(True)",
        "tup: (1, (2.5, 'a'))",
        "lst: [same tensor as x, 2]",
        "d: {'k': same tensor as t, 3: None}",
        f"obj: <Foo object at {id(foo):#x}> (by identity)",
        f"strong: <NoWeakref object at {id(strong):#x}> (by identity)",
        f"big: <int object at {id(big):#x}> (by identity)",
        "dev: device('cpu')",
        "same: same tensor as x",
        "rest: ('extra',)",
        "kw: {'key': [1.0]}",
    ]
    # Without names: positions.  The entry's property and the miss path's own
    # description (explain(), logs: EntryInfo.key) read the same bytes.
    unnamed = entry.key_description
    assert unnamed == _C.describe_call_key(entry)
    assert unnamed[1] == "#0:" + got[1].split(":", 1)[1]
    assert unnamed[27] == "#26: same tensor as #0"
    assert entry.info.key == list(got)


def test_explain_shows_the_c_description():
    report = nnscaler.explain(lambda x, n: x * n, torch.zeros(2, 3), 4)
    text = str(report)
    assert "key  x: Tensor(float32, cpu, shape=(2, 3), stride=(3, 1), requires_grad=False)" in text
    assert "key  n: 4" in text


def _one(x, v):
    return x + 1


def test_equal_descriptions_hit_the_same_entry_and_different_ones_do_not():
    np = pytest.importorskip("numpy")
    foo = Foo()
    values = {
        "int 3": 3, "int 3, another object": int("3"), "int 4": 4, "float 3.0": 3.0,
        "True": True, "str": "a", "None": None, "tuple": (1, 2), "list": [1, 2],
        "Size": torch.Size([1, 2]), "float64 scalar": np.float64(1.0),
        "float32 scalar": np.float32(1.0), "tensor": torch.zeros(2),
        "tensor, another": torch.ones(2), "float64 tensor": torch.zeros(2, dtype=torch.float64),
        "transposed": torch.zeros(3, 2).t(), "transposed, contiguous": torch.zeros(2, 3),
        "parameter": nn.Parameter(torch.zeros(2)), "subclass": torch.zeros(2).as_subclass(Plain),
        "requires_grad": torch.zeros(2, requires_grad=True), "foo": foo, "foo again": foo,
        "another Foo": Foo(), "device": torch.device("cpu"), "dict": {"a": (1, None)},
        "nested": [(1, [2.0, {"b": "c"}])],
    }
    x = torch.zeros(2)
    # Each value's description, from a cache of its own.
    own = {}
    for name, v in values.items():
        g = nnscaler.compile(_one)
        g(x, v)
        own[name] = _only_entry(g).key_description
    # One cache for all: a call hits an entry iff their descriptions are equal.
    g = nnscaler.compile(_one, cache_size_limit=len(values))
    for name, v in values.items():
        before = {id(e): (e, e.hits) for e in _entries(g)}
        g(x, v)
        served = [e for e in _entries(g) if id(e) not in before or e.hits != before[id(e)][1]]
        assert len(served) == 1, name
        entry = served[0]
        assert entry.key_description == own[name], name
        existing = [e.key_description for e, _ in before.values()]
        if id(entry) in before:
            assert existing.count(own[name]) == 1, name
        else:
            assert own[name] not in existing, name
    descriptions = [e.key_description for e in _entries(g)]
    assert len(set(descriptions)) == len(descriptions) == len(set(own.values()))
    # the pairs this set holds on purpose: equal keys, one entry each
    assert own["int 3"] == own["int 3, another object"]
    assert own["tensor"] == own["tensor, another"]
    assert own["foo"] == own["foo again"]
    assert own["transposed"] != own["transposed, contiguous"]


def test_call_key_of_values_is_the_key_a_call_stores():
    x = torch.zeros(2, 3)
    g = nnscaler.compile(_one)
    g(x, (1, "a"))
    entry = _only_entry(g)
    key = _C.CallKey(x, (1, "a"))   # built by the same C code, from Python
    assert key.hash == entry.key_hash
    assert _C.describe_call_key(key) == entry.key_description
    assert _C.describe_call_key(key, names=("x", "v"))[2] == "v: (1, 'a')"
    assert _C.CallKey(x, (1, "b")).hash != entry.key_hash
    with torch.no_grad():
        assert _C.describe_call_key(_C.CallKey(x))[0] == "grad_mode: False"
    with pytest.raises(TypeError):
        _C.describe_call_key(object())


class Trap(torch.Tensor):
    """A subclass whose metadata getters (Python) count their reads and, once armed,
    raise: describing a key must not call them."""
    armed = False
    reads = 0

    @staticmethod
    def _read():
        if Trap.armed:
            raise AssertionError("a tensor getter ran while describing the key")
        Trap.reads += 1

    @property
    def shape(self):
        Trap._read()
        return torch.Tensor.shape.__get__(self)

    def stride(self, *args):
        Trap._read()
        return super().stride(*args)


def test_describing_runs_no_python():
    g = nnscaler.compile(lambda x: x * 2)
    trap = torch.ones(2, 3).as_subclass(Trap)
    Trap.reads = 0
    g(trap)
    assert Trap.reads > 0   # the key read them (a subclass goes through Python)
    entry = _only_entry(g)
    Trap.armed = True
    try:
        reads = Trap.reads
        assert entry.key_description[1] == (
            "#0: Trap(float32, cpu, shape=(2, 3), stride=(3, 1), requires_grad=False)")
        assert _C.describe_call_key(entry, ["x"])[1].startswith("x: Trap(float32")
        assert Trap.reads == reads
    finally:
        Trap.armed = False


def test_objects_the_key_pins_are_named_through_their_pins():
    """A miss with entries present takes the lookup's key (C only: no Python ran) and
    pins its objects from its bytes; the description names them through those pins."""
    g = nnscaler.compile(_one)
    foo, strong = Foo(), NoWeakref()
    g(torch.zeros(2), (foo, strong))
    g(torch.zeros(3), (foo, strong))     # second entry: the lookup key, reused
    g(torch.zeros(4), (Foo(), strong))   # a third, for an object that dies
    gc.collect()
    entries = _entries(g)
    assert len(entries) == 3
    lines = sorted(e.key_description[2] for e in entries)
    pinned = f"#1: (<Foo object at {id(foo):#x}> (by identity), " \
             f"<NoWeakref object at {id(strong):#x}> (by identity))"
    assert lines.count(pinned) == 2
    dead = [line for line in lines if line != pinned]
    assert len(dead) == 1 and "collected> (by identity)" in dead[0], dead
    # the pins are what makes an entry stale when an object it names dies
    assert [e.check_verbose() is None for e in entries] == \
        [e.key_description[2] == pinned for e in entries]
    del foo
    gc.collect()
    assert all("collected> (by identity), <NoWeakref object at" in e.key_description[2]
               for e in entries)
    assert all(e.check_verbose() is not None for e in entries)


class Sneaky(nn.Module):
    """Reading `training` (a real flag in the instance __dict__, branched on: the entry
    guards it) goes through a Python __getattribute__, so the guard check runs Python;
    with a victim set, that read resizes the argument.  The lookup's key then no
    longer describes the argument: the miss path must build the key again rather than
    store the stale one with a graph traced on the resized tensor."""
    victim = [None]

    def __getattribute__(self, name):
        if name == "training" and Sneaky.victim[0] is not None:
            x, Sneaky.victim[0] = Sneaky.victim[0], None
            x.resize_(4, 3).fill_(1.0)
        return super().__getattribute__(name)

    def forward(self, x):
        if self.training:
            return x.sum(0) * 10
        return x.sum(0) * x.shape[0]


def test_a_guard_check_that_changes_the_arguments_gets_a_fresh_key():
    # dynamic=False: one entry per shape, whose keys are what this test reads
    eager, model = Sneaky(), nnscaler.compile(Sneaky(), dynamic=False)
    for m in (eager, model):
        m(torch.ones(2, 3))              # captured in training mode
        m.eval()
        x = torch.ones(2, 3)
        Sneaky.victim[0] = x
        assert torch.equal(m(x), torch.full((3,), 16.0))   # resized to (4, 3) first
        assert Sneaky.victim[0] is None and x.shape == (4, 3)
    # a stale (2, 3) key on the graph traced at (4, 3) would answer these with 8s
    for shape in [(2, 3), (4, 3), (2, 3)]:
        x = torch.ones(*shape)
        assert torch.equal(model(x), eager(x)), shape
    keys = sorted(e.key_description[1].split("shape=")[1][:6] for e in _entries(model))
    assert keys == ["(2, 3)", "(2, 3)", "(4, 3)"]   # (2, 3) training, (4, 3) and (2, 3) eval


def test_tensors_past_the_alias_limit_say_so():
    xs = [torch.zeros(1) for _ in range(66)]
    g = nnscaler.compile(lambda *xs: xs[0] + 1)
    g(*xs, xs[0])
    line = _only_entry(g).key_description[1]
    assert line.count("aliasing not tracked") == 2
    assert line.endswith("same tensor as #0[0])")


def _sum8(a, b, c, d, e, f, g, h):
    return a + b + c + d + e + f + g + h


def _sum8_other(a, b, c, d, e, f, g, h):
    return a - b + c - d + e - f + g - h


def test_a_key_built_inside_another_key_gets_its_own_block():
    """Keys of more than six inputs borrow one kept block (guards/call_key.c, the
    spare).  A subclass's getter that calls another compiled function with as many
    inputs, while the outer key is half built, must not write into the outer key's
    block: both calls stay correct, and the outer one still hits."""
    inner = nnscaler.compile(_sum8_other)
    ones = [torch.full((3,), float(i)) for i in range(8)]
    inner_results = []

    class Reentrant(torch.Tensor):
        @property
        def shape(self):
            inner_results.append(inner(*ones))
            return super().shape

    outer = nnscaler.compile(_sum8)
    xs = [torch.full((3,), float(i)) for i in range(7)]
    special = torch.full((3,), 10.0).as_subclass(Reentrant)
    for _ in range(4):
        got = outer(*xs, special).as_subclass(torch.Tensor)
        assert torch.equal(got, torch.full((3,), 31.0))
    assert len(inner_results) >= 4
    assert all(torch.equal(r, torch.full((3,), -4.0)) for r in inner_results)
    assert nnscaler.cache_info(outer).hits >= 2 and nnscaler.cache_info(inner).hits >= 2


def _sum12(*xs):
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


def _sum12_other(*xs):
    out = xs[0]
    for x in xs[1:]:
        out = out - x
    return out


def test_aliases_past_the_linear_scan_are_found():
    """Past 4 tensors aliases are found through a hashed set (guards/call_key.c): which
    slots are one tensor is still part of the key, wherever the pair lies."""
    xs = [torch.full((2,), float(i)) for i in range(12)]
    patterns = [list(range(12)), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 3],
                [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 11], [0] * 12,
                [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 3]]
    keys = [_C.call_key_bytes(_C.CallKey(*[xs[i] for i in p])) for p in patterns]
    assert keys[1] == keys[4] and len({keys[0], keys[1], keys[2], keys[3]}) == 4
    g = nnscaler.compile(_sum12)
    for p in patterns:
        args = [xs[i] for i in p]
        assert torch.equal(g(*args), _sum12(*args)), p
    assert nnscaler.cache_info(g).hits == 1   # the repeated pattern


def test_each_pinned_object_that_dies_makes_its_entry_stale():
    """An entry checks each distinct weak pin once (guards/cache.c, collect_weak_pins:
    the tensor class a key pins per tensor is one weakref).  Whichever object dies,
    first, last, or one between long runs of tensors, the entry goes stale."""
    def fn(*args):
        return args[0] + 1
    g = nnscaler.compile(fn, cache_size_limit=64)
    t = torch.zeros(2)
    for victim in range(12):
        objs = [Foo() for _ in range(12)]
        args = [t]
        for i in range(len(objs)):
            args += [objs[i]] + [torch.zeros(2)] * (i % 3) + [torch.zeros(1) for _ in range(i % 5)]
        g(*args)
        entry = next(e for e in _entries(g) if e.check_verbose() is None
                     and f"{id(objs[victim]):#x}" in " ".join(e.key_description))
        del args
        objs[victim] = None
        gc.collect()
        assert entry.check_verbose() is not None, victim


def test_a_record_holds_only_the_tensors_own_dimensions():
    """Sizes and strides of short tensors are copied as fixed blocks
    (guards/tensor_meta.cpp); what lies past the tensor's own dimensions (a shrunk
    tensor's old sizes) must not reach the key."""
    fresh = [torch.zeros(6, 20), torch.zeros(5), torch.zeros(()), torch.zeros(2, 3, 4),
             torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4, 5), torch.zeros(1, 1, 2, 1, 3, 1)]
    for want in fresh:
        grown = torch.zeros(7, 8, 9, 10)
        grown.resize_(want.shape)        # in place: the old dims stay in the storage
        assert grown.shape == want.shape and grown.stride() == want.stride()
        assert _C.call_key_bytes(_C.CallKey(grown)) == _C.call_key_bytes(_C.CallKey(want))
    # and through a compiled function: one entry per shape, every answer eager's
    g = nnscaler.compile(lambda x: x.sum(-1, keepdim=True) + x.dim(), cache_size_limit=16)
    x = torch.arange(7 * 8 * 9 * 10.0).reshape(7, 8, 9, 10)
    for shape in [(7, 8, 9, 10), (7, 8, 9), (5, 4), (7, 8, 9, 10), (3,), (5, 4)]:
        y = x.clone().resize_(shape)
        assert torch.equal(g(y), y.sum(-1, keepdim=True) + y.dim()), shape
    assert nnscaler.cache_info(g).hits == 2


class _ManyInputs(nn.Module):
    def forward(self, *xs):
        out = xs[0] * 1
        for i, x in enumerate(xs[1:]):
            out = out + x * (i + 2)
        return out


def _positional(n):
    """A module whose forward takes exactly n positional tensors (a frameless call
    through the compiled wrapper: guards/..csrc/compiled_call.c, call_forward)."""
    names = [f"x{i}" for i in range(n)]
    ns = {}
    exec(f"def forward(self, {', '.join(names)}):\n"
         f"    return _ManyInputs.forward(self, {', '.join(names)})\n",
         {"_ManyInputs": _ManyInputs}, ns)
    return type(f"Positional{n}", (nn.Module,), {"forward": ns["forward"]})()


@pytest.mark.parametrize("n", [1, 8, 9, 63, 64, 65, 100])
def test_many_positional_tensors_hit_and_match_eager(n):
    """Plain positional calls of any arity take the frameless hit (no forward frame);
    aliases, an in-place change of one input's shape or strides, and a non-tensor
    argument all still key correctly."""
    m = _positional(n)
    eager = _positional(n)
    compiled = nnscaler.compile(m)
    xs = [torch.full((2, 3), float(i)) for i in range(n)]
    patterns = [list(range(n)), [0] * n, [min(i, n - 1) for i in range(1, n + 1)]]
    for _ in range(2):
        for p in patterns:
            args = [xs[i] for i in p]
            assert torch.equal(compiled(*args), eager.forward(*args)), p
    info = nnscaler.cache_info(compiled)
    assert info.hits >= len(patterns) - (n == 1), info
    # one input changed in place: a new shape, then new strides
    last = xs[n // 2]
    last.resize_(3, 2)
    args = [x if x is last else x.view(3, 2) for x in xs]
    assert torch.equal(compiled(*args), eager.forward(*args))
    last.t_()
    args = [x if x is last else x.view(3, 2).t() for x in xs]
    assert torch.equal(compiled(*args), eager.forward(*args))
    # anything but a tensor, None or a bool takes the frame path, as before
    args[-1] = 2.0
    if n > 1:
        assert torch.equal(compiled(*args), eager.forward(*args))


@pytest.mark.parametrize("at", [1, 4, 9])   # the linear scan, the set's start, the set
def test_a_key_built_inside_a_key_past_the_linear_scan(at):
    """A subclass's getter, met at tensor `at` (compared one by one, the alias set
    being made, or in use), calls another compiled function of twelve inputs with
    aliases of its own: each key keeps its own set, both calls stay correct and
    hit."""
    inner = nnscaler.compile(_sum12_other)
    ones = [torch.full((3,), float(i)) for i in range(11)]
    inner_args = ones + [ones[9]]
    inner_results = []

    class Reentrant(torch.Tensor):
        @property
        def shape(self):
            inner_results.append(inner(*inner_args))
            return super().shape

    outer = nnscaler.compile(_sum12)
    xs = [torch.full((3,), float(i)) for i in range(9)]
    special = torch.full((3,), 10.0).as_subclass(Reentrant)
    args = xs[:at] + [special] + xs[at:] + [xs[2], special]
    want = _sum12(*[a.as_subclass(torch.Tensor) for a in args])
    for _ in range(4):
        assert torch.equal(outer(*args).as_subclass(torch.Tensor), want)
    assert all(torch.equal(r, _sum12_other(*inner_args)) for r in inner_results)
    assert len(inner_results) >= 4
    assert nnscaler.cache_info(outer).hits >= 2 and nnscaler.cache_info(inner).hits >= 2


# --- objects keyed by their contents (TAG_STRUCT: transformers KV caches) -----------

class Holder:
    """A stand-in for a KV cache class: registered, its instances are keyed by their
    type and __dict__."""


class OtherHolder(Holder):
    pass


@pytest.fixture
def holders_keyed():
    from nnscaler_eval.guarding import keyed_objects
    _C.set_key_struct_types(keyed_objects.registered() + (Holder, OtherHolder))
    try:
        yield
    finally:
        _C.set_key_struct_types(keyed_objects.registered())


def _holder(cls=Holder, **attributes):
    obj = cls()
    vars(obj).update(attributes)
    return obj


def test_registered_objects_are_keyed_by_class_and_contents(holders_keyed):
    a = _holder(keys=torch.ones(2, 3), n=3, layers=[_holder(v=torch.zeros(4))])
    b = _holder(keys=torch.ones(2, 3), n=3, layers=[_holder(v=torch.zeros(4))])
    key = _C.CallKey(a)
    assert _C.call_key_bytes(key) == _C.call_key_bytes(_C.CallKey(b))   # not identity
    for other in (_holder(keys=torch.ones(2, 4), n=3, layers=[_holder(v=torch.zeros(4))]),
                  _holder(keys=torch.ones(2, 3), n=4, layers=[_holder(v=torch.zeros(4))]),
                  _holder(OtherHolder, keys=torch.ones(2, 3), n=3,
                          layers=[_holder(v=torch.zeros(4))]),
                  _holder(keys=torch.ones(2, 3), n=3, layers=[_holder(v=torch.zeros(4))],
                          extra=None)):
        assert _C.call_key_bytes(_C.CallKey(other)) != _C.call_key_bytes(key)
    # the same tensor twice inside: an alias, as for arguments
    t = torch.ones(2)
    assert (_C.call_key_bytes(_C.CallKey(_holder(k=t, v=t)))
            != _C.call_key_bytes(_C.CallKey(_holder(k=t, v=torch.ones(2)))))
    words = _C.describe_call_key(key, names=("cache",))[1]
    assert words.startswith("cache: Holder{'keys': Tensor(float32, cpu, shape=(2, 3)")
    assert "'layers': [Holder{'v': Tensor(float32" in words
    # unregistered: by identity, as any object
    _C.set_key_struct_types(())
    assert "(by identity)" in _C.describe_call_key(_C.CallKey(a))[1]


def test_nested_layout_names_every_field_inside_keyed_objects(holders_keyed):
    obj = _holder(keys=torch.ones(2, 3), n=3, x=1.5,
                  layers=[_holder(v=torch.zeros(4))], table={"k": torch.ones(1), 2: 5})
    vars(obj)[7] = torch.ones(3)   # a key that is not a name: not a field
    key = _C.CallKey(torch.ones(2), obj, (4, torch.ones(2)))
    nested = _C.call_key_nested_layout(key)
    paths = [item[-1] for item in nested]
    assert paths == [(1, ("a", "keys")), (1, ("a", "n")), (1, ("a", "x")),
                     (1, ("a", "layers"), ("i", 0), ("a", "v")),
                     (1, ("a", "table"), ("k", "k")), (1, ("a", "table"), ("k", 2))]
    assert [item[0] for item in nested] == ["tensor", "int", "float", "tensor", "tensor", "int"]
    data = _C.call_key_bytes(key)
    offset, ndim = nested[0][1], nested[0][2]
    assert ndim == 2 and [int.from_bytes(data[offset + 8 * d:offset + 8 * d + 8], "little",
                                         signed=True) for d in range(2)] == [2, 3]
    assert int.from_bytes(data[nested[1][1]:nested[1][1] + 8], "little") == 3
    assert _C.call_key_nested_layout(_C.CallKey(torch.ones(2), (1, [2]))) == ()


class Emptying(torch.Tensor):
    """A subclass whose shape getter (Python, run while the key is built) empties the
    object holding it and drops what it held."""
    victim = None

    @property
    def shape(self):
        if Emptying.victim is not None:
            vars(Emptying.victim).clear()
            Emptying.victim = None
        return torch.Tensor.shape.__get__(self)


def test_python_run_while_a_keyed_object_is_read_cannot_free_what_the_walk_holds(
        holders_keyed):
    for _ in range(3):
        obj = _holder(first=torch.ones(2).as_subclass(Emptying), second=torch.ones(3),
                      tail=[torch.ones(4) for _ in range(3)])
        Emptying.victim = obj
        words = _C.describe_call_key(_C.CallKey(obj))[1]
        assert "'second': Tensor(float32, cpu, shape=(3,)" in words   # the snapshot
        assert vars(obj) == {}


def test_set_key_struct_types_rejects_bad_input():
    from nnscaler_eval.guarding import keyed_objects
    for bad in ([Holder], (Holder, 3), (int,), tuple([Holder] * 33)):
        with pytest.raises(TypeError, match="set_struct_types"):
            _C.set_key_struct_types(bad)
    assert _C.CallKey(_holder()) is not None
    _C.set_key_struct_types(keyed_objects.registered())


def test_rebuild_builds_the_key_again_in_place(holders_keyed):
    key = _C.CallKey(torch.ones(2), 3)
    before = _C.call_key_bytes(key)
    key.rebuild(torch.ones(2, 2), 3)
    assert _C.call_key_bytes(key) == _C.call_key_bytes(_C.CallKey(torch.ones(2, 2), 3))
    assert _C.call_key_bytes(key) != before


def test_one_object_reached_twice_keys_unlike_two_equal_objects(holders_keyed):
    """The runner writes into keyed objects: one cache passed twice (or one list in two
    layers) must not hit an entry captured with two equal ones."""
    def fresh():
        return _holder(keys=torch.ones(2), items=[1, 2])
    one = fresh()
    both = _C.call_key_bytes(_C.CallKey(one, one))
    apart = _C.call_key_bytes(_C.CallKey(fresh(), fresh()))
    assert both != apart
    assert "the same object as shared object #0" in _C.describe_call_key(
        _C.CallKey(one, one))[2]
    shared_list = [torch.ones(1)]
    a, b = _holder(layers=shared_list), _holder(layers=shared_list)
    c, d = _holder(layers=[torch.ones(1)]), _holder(layers=[torch.ones(1)])
    assert _C.call_key_bytes(_C.CallKey(a, b)) != _C.call_key_bytes(_C.CallKey(c, d))
    # plain lists outside keyed objects are keyed by value, as before
    plain = [1, 2]
    assert _C.call_key_bytes(_C.CallKey(plain, plain)) == _C.call_key_bytes(
        _C.CallKey([1, 2], [1, 2]))
    # many layers: the record of objects met grows past its inline room
    many = _holder(layers=[_holder(k=torch.ones(1)) for _ in range(40)])
    again = _holder(layers=[_holder(k=torch.ones(1)) for _ in range(40)])
    assert _C.call_key_bytes(_C.CallKey(many)) == _C.call_key_bytes(_C.CallKey(again))
    many.layers.append(many.layers[3])
    again.layers.append(_holder(k=torch.ones(1)))
    assert _C.call_key_bytes(_C.CallKey(many)) != _C.call_key_bytes(_C.CallKey(again))


class _Releasing:
    """Its __del__ (run when a key build drops the last reference to it) empties a
    list another keyed object holds, which the build reaches next."""
    def __init__(self, target):
        self.target = target

    def __del__(self):
        self.target.clear()


def test_a_finaliser_run_while_keying_objects_leaves_a_sound_key(holders_keyed):
    for _ in range(3):
        later = [torch.ones(2), _holder(k=torch.ones(3))]
        first = _holder(first=torch.ones(2).as_subclass(Emptying), gone=_Releasing(later))
        Emptying.victim = first    # its getter drops `gone`; the snapshot keeps it a while
        second = _holder(layers=later)
        key = _C.CallKey(first, second)
        words = _C.describe_call_key(key)
        assert words[1].startswith("#0: Holder{'first': Emptying(")
        assert later == []          # the finaliser ran during the build
        assert "#1: Holder{'layers': []}" == words[2]   # and the key read the list after
        assert _C.call_key_bytes(_C.CallKey(first, second)) != _C.call_key_bytes(key)


def test_replacing_the_keyed_classes_frees_a_class_no_one_else_holds():
    import gc
    from nnscaler_eval.guarding import keyed_objects
    ephemeral = type("Ephemeral", (), {})
    obj = ephemeral()
    obj.k = torch.ones(1)
    _C.set_key_struct_types(keyed_objects.registered() + (ephemeral,))
    key = _C.CallKey(obj)
    assert "Ephemeral{'k': Tensor" in _C.describe_call_key(key)[1]
    del obj, ephemeral
    _C.set_key_struct_types(keyed_objects.registered())   # drops the last strong reference
    gc.collect()
    assert _C.describe_call_key(key)[1].startswith("#0: ")   # the key's pin names it weakly
