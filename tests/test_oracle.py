"""The tests' oracle (tests/oracle.py) and the state fuzzer (tests/state_fuzz.py) fail
where they must: a different structure, a shorter or longer output, one changed leaf,
a call the cache did not serve where a hit was expected, a compiled twin that answers
where eager raises, and a model that always ran eagerly."""
from __future__ import annotations

import collections
import copy
import dataclasses
import types

import pytest
import torch
import torch.nn as nn

import nnscaler
import state_fuzz
from oracle import agree, assert_same, same, served, twins


def _fails(got, want, match, **tolerance):
    with pytest.raises(AssertionError, match=match):
        assert_same(got, want, **tolerance)
    assert not same(got, want, **tolerance)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extra: object = None


class Layer:
    """A plain object (no __eq__), like a KV cache layer: compared by its __dict__."""

    def __init__(self, keys, length):
        self.keys = keys
        self.length = length


def test_equal_structures_pass():
    x = torch.randn(3, 4)
    out = (x, [x * 2, {"a": x, "n": 3, "s": "tag", "none": None}],
           Output(x, Layer(x, 5)), float("nan"), torch.tensor([float("nan"), 1.0]))
    assert_same(out, copy.deepcopy(out))
    assert same(out, copy.deepcopy(out))


def test_a_shorter_or_longer_output_fails():
    # zip((a, b), (a,)) pairs one leaf and passes; the oracle counts them
    a, b = torch.ones(2), torch.zeros(2)
    _fails((a,), (a, b), r"the output: 1 items, eager 2")
    _fails((a, b), (a,), r"the output: 2 items, eager 1")
    _fails([[a]], [[a, b]], r"\[0\]: 1 items, eager 2")
    _fails({"x": a}, {"x": a, "y": b}, r"keys \['x'\], eager \['x', 'y'\]")
    _fails(torch.ones(2), torch.ones(3), r"shape \(2,\), eager \(3,\)")


def test_a_different_structure_fails():
    a = torch.ones(2)
    _fails([a], (a,), r"list, eager tuple")
    _fails({"x": a}, collections.OrderedDict(x=a), r"dict, eager OrderedDict")
    _fails(a, (a,), r"Tensor, eager tuple")
    _fails((a,), a, r"tuple, eager a tensor")
    _fails(None, a, r"NoneType, eager a tensor")
    _fails(Output(a), Layer(a, 1), r"Output, eager Layer")
    _fails({"y": a, "x": a}, {"x": a, "y": a}, r"keys \['y', 'x'\]")
    _fails(a.double(), a, r"dtype torch.float64, eager torch.float32")


def test_one_changed_leaf_fails_and_names_its_path():
    x = torch.randn(2, 3)
    want = (x, {"logits": Output(x, Layer(x, 4))})
    changed = x.clone()
    changed[1, 2] += 1e-3
    _fails((x, {"logits": Output(changed, Layer(x, 4))}), want,
           r"\[1\]\['logits'\]\.logits: values differ")
    _fails((x, {"logits": Output(x, Layer(changed, 4))}), want,
           r"\.extra\.__dict__\['keys'\]: values differ")
    _fails((x, {"logits": Output(x, Layer(x, 5))}), want, r"\['length'\]: 5, eager 4")
    _fails((x, {"logits": Output(x, Layer(x, 4.0))}), want, r"4.0, eager 4 \(int\)")
    _fails(["gat"], ["tag"], r"\[0\]: 'gat', eager 'tag'")
    _fails(float("nan"), 1.0, r"nan, eager 1.0")
    _fails(1.0, float("nan"), r"1.0, eager nan")
    # within a tolerance asked for, and only then
    assert same(changed, x, atol=2e-3) and not same(changed, x, atol=1e-4)


class Doubles(nn.Module):
    def forward(self, x):
        return (x * 2,)


class DoublesAndMore(nn.Module):
    def forward(self, x):
        return (x * 2, x)


def test_agree_requires_a_hit_where_one_is_expected():
    compiled, eager = twins(Doubles())
    x = torch.randn(3)
    with pytest.raises(AssertionError, match="expected a hit; this call made 1 capture"):
        agree(compiled, eager, x, expect="hit")   # the first call captures
    agree(compiled, eager, x, expect="hit")
    assert served(compiled) == (1, 1, 0)
    # a module that was never compiled runs eagerly: equal outputs, no hit
    plain = Doubles()
    with pytest.raises(AssertionError, match="expected a hit; this call made 0 capture"):
        agree(plain, Doubles(), x, expect="hit")
    with pytest.raises(AssertionError, match="expected a capture"):
        agree(plain, Doubles(), x, expect="capture")


def test_agree_fails_on_an_output_shorter_than_eager():
    compiled = nnscaler.compile(Doubles())
    with pytest.raises(AssertionError, match="1 items, eager 2"):
        agree(compiled, DoublesAndMore(), torch.randn(3))


class Table(nn.Module):
    """Reads a dict entry: deleting it makes eager raise KeyError."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.table = {"scale": 2.0}

    def forward(self, x):
        return self.fc(x) * self.table["scale"]


def _inputs():
    return (torch.randn(2, 4),), {}


def _fuzz_with(monkeypatch, compile_):
    monkeypatch.setattr(state_fuzz, "nnscaler", types.SimpleNamespace(
        compile=compile_, cache_info=nnscaler.cache_info))
    return state_fuzz.fuzz(Table, _inputs, mutations=50, name="table")


def test_the_fuzzer_passes_the_real_compiler():
    report = state_fuzz.fuzz(Table, _inputs, mutations=50, name="table")
    assert report.tried >= 5 and report.raised >= 1 and report.hits > 0, report
    assert not report.stale, report.stale


def test_the_fuzzer_fails_a_stale_twin_that_answers_where_eager_raises(monkeypatch):
    # compiled from a copy made before any change: it never sees one (a stale cache)
    report = _fuzz_with(monkeypatch, lambda m: nnscaler.compile(copy.deepcopy(m)))
    assert any("eager raised KeyError, compiled returned" in s for s in report.stale), report.stale
    assert any("rebind to" in s for s in report.stale), report.stale


def test_the_fuzzer_fails_a_model_that_always_ran_eagerly(monkeypatch):
    # "compiled" as the module itself: every answer is eager's, and no call hits
    report = _fuzz_with(monkeypatch, lambda m: m)
    assert report.stale == ["table: the second call with the same state did not hit "
                            "(CacheInfo(captures=0, hits=0, misses=0, fallbacks=0, entries=0))"]
