"""The C cache entry: guards by dict version and by training-flag value."""
from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

from nnscaler_eval import _C


def make_entry(dicts=(), flags=(), names=None, runner=None, modules=()):
    names = names if names is not None else [f"g{i}" for i in range(len(dicts) + len(flags))]
    return _C.CacheEntry(runner, list(modules), list(dicts), list(flags), names, {"info": 1})


def test_dict_version_guard_goes_stale_on_any_change():
    d = {"a": 1}
    e = make_entry([d], names=["hooks of self"])
    assert e.check_verbose() is None
    d["a"] = 1  # the same object stored again: CPython leaves the version alone
    assert e.check_verbose() is None
    d["a"] = 2
    assert e.check_verbose() == "hooks of self"
    e2 = make_entry([d])
    d.pop("a")
    assert e2.check_verbose() == "g0"


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
        (dict(dicts=[[]]), TypeError, r"dict_guards\[0\] is a list"),
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
