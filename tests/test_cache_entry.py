"""The C cache entry: value guards on dicts (re-validated when a version moves) and
training-flag guards by value."""
from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

from nnscaler_eval import _C
from nnscaler_eval.guarding.state_guards import MISSING, VG_DICT


def make_entry(dicts=(), flags=(), names=None, runner=None, modules=()):
    """`dicts` are guarded as guard_builder guards the module tree: the same objects
    under exactly the same keys."""
    names = names if names is not None else [f"g{i}" for i in range(len(flags) + len(dicts))]
    specs = [(VG_DICT, d, tuple(d), tuple(d.values()), MISSING, None, True)
             if isinstance(d, dict) else (VG_DICT, d) for d in dicts]
    return _C.CacheEntry(runner, list(modules), list(flags), names, {"info": 1}, specs)


def test_dict_guard_follows_the_contents_both_ways():
    marker = object()
    d = {"a": marker}
    e = make_entry([d], names=["hooks of self"])
    assert e.check_verbose() is None
    d["a"] = marker  # the same object stored again
    assert e.check_verbose() is None
    d["a"] = object()
    assert e.check_verbose() == "hooks of self"
    d["a"] = marker   # put back: valid again
    assert e.check_verbose() is None
    d["b"] = marker
    assert e.check_verbose() == "hooks of self"


def test_flag_guard_follows_the_value_both_ways():
    m = torch.nn.Linear(1, 1).train()
    e = make_entry(flags=[(m, True)], names=["self.training == True"])
    assert e.check_verbose() is None
    m.eval()
    assert e.check_verbose() == "self.training == True"
    m.train()
    assert e.check_verbose() is None


def test_entry_holds_modules_weakly():
    m = torch.nn.Linear(1, 1)
    ref = weakref.ref(m)
    e = make_entry(flags=[(m, True)], modules=[m])
    del m
    gc.collect()
    assert ref() is None
    assert e.check_verbose() is not None  # a guarded module died: stale


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(runner=3), TypeError, "callable"),
        (dict(dicts=[[]]), (TypeError, ValueError), r"value_guards\[0\]|expected"),
        (dict(flags=[(torch.nn.Linear(1, 1),)]), TypeError, r"flag_guards\[0\]"),
        (dict(dicts=[{}], names=[]), ValueError, "0 guard_names for 1 guards"),
        (dict(modules=[object()]), TypeError, "weak"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_entry(**kwargs)


def test_refcounts_of_guarded_objects_are_released():
    d = {}
    m = torch.nn.Linear(1, 1)
    before = (sys.getrefcount(d), sys.getrefcount(m))
    for _ in range(1000):
        make_entry([d], flags=[(m, True)], modules=[m])
    assert (sys.getrefcount(d), sys.getrefcount(m)) == before


def test_dict_version_helper():
    d = {}
    v = _C.dict_version(d)
    d[1] = 2
    assert _C.dict_version(d) != v
    with pytest.raises(TypeError):
        _C.dict_version([])
