"""State a capture read, changed after it: each kind of Python state a forward can read
gives eager's answer after the change, and again after it is reverted (a recapture or
an eager run is fine; a stale hit is the failure).  Issue 19's list; the fuzzer
(test_state_fuzz.py) searches for kinds nobody listed."""
from __future__ import annotations

import array
import functools
import os
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import helper_functions
import nnscaler
from oracle import assert_same


def _differential(make, change, revert=None, args=lambda: (torch.randn(3, 4),), calls=2):
    """Eager and compiled twins; `change(model, args)` and `revert` applied to both."""
    torch.manual_seed(0)
    eager = make()
    ours = make()
    ours.load_state_dict(eager.state_dict())
    compiled = nnscaler.compile(ours)
    inputs = args()

    def agree(stage):
        for _ in range(calls):
            want = eager(*inputs)
            got = compiled(*inputs)
            try:
                assert_same(got, want)
            except AssertionError as exc:
                raise AssertionError(f"{stage}: {exc}") from None

    def both(step):
        for model in (eager, ours):
            torch.manual_seed(1)
            step(model, inputs)

    agree("before the change")
    both(change)
    agree("after the change")
    if revert is not None:
        both(revert)
        agree("after reverting it")
    return compiled


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)])
        self.named = nn.ModuleDict({"a": nn.Linear(4, 4)})

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        for key in self.named:
            x = self.named[key](x)
        return x


_kept: list = []


def _replace_first(model, _):
    _kept.append(model.layers[0])      # the old layer stays alive elsewhere
    model.layers[0] = nn.Linear(4, 4)


@pytest.mark.parametrize("change,revert", [
    (lambda m, _: m.layers.append(nn.Linear(4, 4)), lambda m, _: m.layers.__delitem__(-1)),
    (lambda m, _: m.named.update({"b": nn.Linear(4, 4)}), lambda m, _: m.named.pop("b")),
    (_replace_first, None),
], ids=["ModuleList.append", "ModuleDict new key", "slot replaced"])
def test_module_containers(change, revert):
    _differential(Stack, change, revert)


class UsesHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return helper_functions.act(self.proj(x))


def test_function_of_another_module_monkeypatched():
    original = helper_functions.act
    try:
        _differential(UsesHelper, lambda m, _: setattr(helper_functions, "act", torch.tanh),
                      lambda m, _: setattr(helper_functions, "act", original))
    finally:
        helper_functions.act = original


FILELESS = types.ModuleType("fileless")
FILELESS.act = torch.relu


class UsesFileless(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return FILELESS.act(self.proj(x))


def test_function_of_a_module_without_a_file_monkeypatched():
    _differential(UsesFileless, lambda m, _: setattr(FILELESS, "act", torch.sigmoid),
                  lambda m, _: setattr(FILELESS, "act", torch.relu))


class UsesTorchFunctions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(F.gelu(self.proj(x)))


@pytest.mark.parametrize("owner,name,other", [
    (F, "gelu", torch.sigmoid), (torch, "tanh", torch.relu)], ids=["F.gelu", "torch.tanh"])
def test_torch_function_replaced_by_the_user(owner, name, other):
    original = getattr(owner, name)
    try:
        _differential(UsesTorchFunctions, lambda m, _: setattr(owner, name, other),
                      lambda m, _: setattr(owner, name, original))
    finally:
        setattr(owner, name, original)


class ReadsTheEnvironment(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        scale = float(os.environ.get("NNS_TEST_SCALE", "1"))
        shift = float(os.getenv("NNS_TEST_SHIFT", "0"))
        return self.proj(x) * scale + shift


@pytest.mark.parametrize("variable", ["NNS_TEST_SCALE", "NNS_TEST_SHIFT"])
def test_environment_variables(variable, monkeypatch):
    monkeypatch.delenv(variable, raising=False)
    _differential(ReadsTheEnvironment, lambda m, _: os.environ.__setitem__(variable, "3"),
                  lambda m, _: os.environ.pop(variable, None))


class UsesPartial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = functools.partial(torch.mul, other=2.0)

    def forward(self, x):
        return self.scale(self.proj(x))


def test_partial_keywords_edited_in_place():
    _differential(UsesPartial, lambda m, _: m.scale.keywords.__setitem__("other", 5.0),
                  lambda m, _: m.scale.keywords.__setitem__("other", 2.0))


TABLE = np.array([1.0, 2.0], dtype=np.float32)
BYTES = bytearray(b"\x01\x02")
WORDS = array.array("i", [3, 4])


class Slotted:
    __slots__ = ("k",)

    def __init__(self) -> None:
        self.k = 1.0


SLOTTED = Slotted()


class ReadsMutableObjects(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * float(TABLE[0]) + BYTES[0] + WORDS[1] + SLOTTED.k


@pytest.mark.parametrize("change,revert", [
    (lambda m, _: TABLE.__setitem__(0, 7.0), lambda m, _: TABLE.__setitem__(0, 1.0)),
    (lambda m, _: BYTES.__setitem__(0, 9), lambda m, _: BYTES.__setitem__(0, 1)),
    (lambda m, _: WORDS.__setitem__(1, 5), lambda m, _: WORDS.__setitem__(1, 4)),
    (lambda m, _: setattr(SLOTTED, "k", 4.0), lambda m, _: setattr(SLOTTED, "k", 1.0)),
], ids=["numpy array", "bytearray", "array.array", "__slots__"])
def test_objects_without_a_dict_version(change, revert):
    _differential(ReadsMutableObjects, change, revert)


def test_numpy_array_too_large_to_compare_runs_eagerly():
    big = np.zeros(300_000, dtype=np.float32)   # 1.2 MB

    class ReadsBig(nn.Module):
        def forward(self, x):
            return x * float(big[5])

    compiled = _differential(ReadsBig, lambda m, _: big.__setitem__(5, 2.0),
                             args=lambda: (torch.ones(2),))
    text = str(nnscaler.explain(nnscaler.compile(ReadsBig()), torch.ones(2)))
    assert "no guard can compare" in text, text
    assert nnscaler.cache_info(compiled).hits == 0


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, config):
        return self.proj(x) * config[0][0][0][0][0][0][0][0][0][0]


def test_list_argument_nested_beyond_the_walk_bound():
    nested = [5.0]
    for _ in range(9):
        nested = [nested]
    innermost = nested
    for _ in range(9):
        innermost = innermost[0]
    _differential(Deep, lambda m, a: innermost.__setitem__(0, 2.0),
                  lambda m, a: innermost.__setitem__(0, 5.0),
                  args=lambda: (torch.randn(3, 4), nested))


class Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 4, batch_first=True)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, h = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return out, h


def test_packed_sequences_with_other_lengths():
    _differential(Packed, lambda m, a: a[1].copy_(torch.tensor([1, 3, 2])),
                  lambda m, a: a[1].copy_(torch.tensor([3, 2, 1])),
                  args=lambda: (torch.randn(3, 3, 4), torch.tensor([3, 2, 1])))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)

    def forward(self, x, mask):
        return self.encoder(x, src_key_padding_mask=mask)


@pytest.mark.parametrize("grad", [False, True])
def test_transformer_encoder_fast_path_in_eval(grad):
    mask = torch.tensor([[False, False, True, True], [False, False, False, True]])
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore")     # torch's nested-tensor prototype warning
        _differential(lambda: Encoder().eval(), lambda m, _: m.train(),
                      lambda m, _: m.eval(), args=lambda: (torch.randn(2, 4, 8), mask))


class GetattributeSlots:
    """Slots read through a __getattribute__ written in Python: the capture reads
    them through it; the slots guard reads them where they live (VG_SLOTS, C)."""
    __slots__ = ("k",)

    def __init__(self) -> None:
        self.k = 1.0

    def __getattribute__(self, name):
        return object.__getattribute__(self, name)


GETATTRIBUTE_SLOTTED = GetattributeSlots()


class ReadsSlots(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * GETATTRIBUTE_SLOTTED.k


def test_slots_guard_runs_no_python_on_a_hit_and_sees_a_raw_write():
    import sys
    eager = ReadsSlots()
    ours = ReadsSlots()
    ours.load_state_dict(eager.state_dict())
    compiled = nnscaler.compile(ours)
    x = torch.randn(2, 4)
    try:
        for _ in range(2):
            torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)
        called = []
        sys.setprofile(lambda frame, event, arg: event == "call" and
                       called.append(frame.f_code.co_name))
        try:
            hits = nnscaler.cache_info(compiled).hits
            compiled(x)
        finally:
            sys.setprofile(None)
        assert nnscaler.cache_info(compiled).hits == hits + 1
        assert "__getattribute__" not in called     # the hit's guards ran no Python
        object.__setattr__(GETATTRIBUTE_SLOTTED, "k", 3.0)     # past __getattribute__ and __setattr__
        torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)
        object.__setattr__(GETATTRIBUTE_SLOTTED, "k", 1.0)
        torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)
    finally:
        object.__setattr__(GETATTRIBUTE_SLOTTED, "k", 1.0)


class ComputedNames(nn.Module):
    """Attributes read by a name computed at run time: in no code's co_names."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.kind = "relu"
        self.scale_relu = 2.0
        self.scale_gelu = 3.0

    def forward(self, x):
        name = "scale_" + self.kind
        if self.how == "getattr":
            scale = getattr(self, name)
        elif self.how == "getattr default":
            scale = getattr(self, name + "_override", None) or getattr(self, name)
        elif self.how == "hasattr":
            scale = 5.0 if hasattr(self, name + "_override") else getattr(self, name)
        elif self.how == "__dict__":
            scale = self.__dict__[name]
        elif self.how == "vars":
            scale = vars(self).get(name + "_override", vars(self)[name])
        elif self.how == "attrgetter":
            import operator
            scale = operator.attrgetter(name)(self)
        else:
            raise AssertionError(self.how)
        return x * scale


@pytest.mark.parametrize("how", ["getattr", "getattr default", "hasattr", "__dict__",
                                 "vars", "attrgetter"])
@pytest.mark.parametrize("change, revert", [
    (lambda m, _: setattr(m, "scale_relu", 5.0), lambda m, _: setattr(m, "scale_relu", 2.0)),
    (lambda m, _: setattr(m, "kind", "gelu"), lambda m, _: setattr(m, "kind", "relu")),
    (lambda m, _: setattr(m, "scale_relu_override", 7.0),
     lambda m, _: delattr(m, "scale_relu_override")),
], ids=["value rebound", "name changed", "attribute added"])
def test_attributes_read_by_a_computed_name(how, change, revert):
    compiled = _differential(lambda: ComputedNames(how), change, revert, calls=3)
    info = nnscaler.cache_info(compiled)
    assert info.captures <= 2 and info.hits >= 6, info   # recaptured once, then hits


class _Rational:
    __slots__ = ("p", "q")

    def __init__(self, p, q) -> None:
        self.p, self.q = p, q


class _One(_Rational):
    """A class attribute over an inherited slot (sympy's One.p): reads find the class's."""
    __slots__ = ()
    p = 1

    def __init__(self) -> None:
        self.q = 1


ONE = _One()


class ReadsShadowedSlot(nn.Module):
    def forward(self, x):
        return x * ONE.p + ONE.q


def test_slot_shadowed_by_a_class_attribute():
    compiled = _differential(ReadsShadowedSlot, lambda m, _: setattr(_One, "p", 3),
                             lambda m, _: setattr(_One, "p", 1))
    info = nnscaler.cache_info(compiled)
    assert info.fallbacks == 0 and info.captures == 2, info


def test_a_slot_beside_a_shadowed_one():
    compiled = _differential(ReadsShadowedSlot, lambda m, _: setattr(ONE, "q", 5),
                             lambda m, _: setattr(ONE, "q", 1))
    assert nnscaler.cache_info(compiled).fallbacks == 0


def _reads(fn) -> bool:
    from nnscaler_eval.guarding.state_guards import reads_by_computed_name
    return reads_by_computed_name(fn.__code__)


def foo(*args):
    return args


@pytest.mark.parametrize("fn, computed", [
    (lambda self: getattr(self, "x"), False),
    (lambda self: getattr(self, "x", None), False),
    (lambda self: hasattr(self.cfg, "y") and getattr(self.cfg.z, "q", self.d), False),
    (lambda self: getattr(self.f(1), "q") + getattr(self.g(self.h), "q", [1, 2]), False),
    (lambda self: getattr(self, "x", 0) + len(getattr(self, "z", ())), False),
    (lambda self: self.x + foo(self, "a"), False),
    (lambda self, n: getattr(self, n), True),
    (lambda self: getattr(self, "x_" + self.k), True),
    (lambda self, k: getattr(self, k, "default"), True),
    (lambda self, k: getattr(self.f(k), "q" + k), True),
    (lambda self: getattr(self, "a" if self.t else "b"), True),
    (lambda self, y: foo(y, "a") + getattr(self, y), True),
    (lambda self, *a: getattr(*a), True),
    (lambda self: foo(getattr)(self, "x"), True),
    (lambda self: vars(self)["x"], True),
    (lambda self: self.__dict__["x"], True),
    (lambda self: self.getattr(1), True),
])
def test_which_code_reads_by_a_computed_name(fn, computed):
    """The bytecode check behind the whole-namespace guards, on this CPython: a
    getattr/hasattr whose name is a string constant is what its constants show;
    anything else that can read by a computed name counts."""
    assert _reads(fn) is computed
