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
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{stage}: {m}")

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


MEDDLE: list = []


class MeddlingSlots:
    """Slots read through a __getattribute__ that runs Python in the middle of the
    cache check (the slots guard reads them on every hit)."""
    __slots__ = ("k",)

    def __init__(self) -> None:
        self.k = 1.0

    def __getattribute__(self, name):
        if name == "k" and MEDDLE:
            MEDDLE.pop()()
        return object.__getattribute__(self, name)


MEDDLING = MeddlingSlots()


class ReadsMeddlingSlots(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * MEDDLING.k


@pytest.mark.parametrize("meddle", ["reset", "collect", "change", "delete the model"])
def test_python_in_the_middle_of_a_content_guard(meddle):
    import gc
    eager = ReadsMeddlingSlots()
    ours = ReadsMeddlingSlots()
    ours.load_state_dict(eager.state_dict())
    compiled = nnscaler.compile(ours)
    x = torch.randn(2, 4)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)
    holder = [compiled]
    actions = {
        "reset": nnscaler.reset,
        "collect": gc.collect,
        "change": lambda: object.__setattr__(MEDDLING, "k", 3.0),
        "delete the model": lambda: (holder.clear(), gc.collect()),
    }
    MEDDLE.append(actions[meddle])
    try:
        got = compiled(x)           # the guard check runs the action
        want = eager(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)
    finally:
        MEDDLE.clear()
        object.__setattr__(MEDDLING, "k", 1.0)
