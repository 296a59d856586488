"""The C cache entry: value guards on dicts (re-validated when a version moves) and
training-flag guards by value."""
from __future__ import annotations

import gc
import sys
import warnings
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


def _value_entry(spec, name="contents"):
    return _C.CacheEntry(None, [], [], [name], {"info": 1}, [spec])


@pytest.mark.parametrize("make", [
    lambda: bytearray(b"\x01\x02\x03"),
    lambda: __import__("array").array("d", [1.0, 2.0]),
    lambda: __import__("numpy").arange(12, dtype="float32").reshape(3, 4),
    lambda: __import__("numpy").arange(12, dtype="int64").reshape(3, 4)[:, ::2],  # strided
    lambda: __import__("numpy").zeros(0),
], ids=["bytearray", "array.array", "ndarray", "strided ndarray", "empty ndarray"])
def test_bytes_guard_compares_contents_and_layout_in_c(make):
    from nnscaler_eval.guarding.state_guards import VG_BYTES
    obj = make()
    e = _value_entry((VG_BYTES, obj))
    assert e.check_verbose() is None
    if len(obj):
        old = obj[0] if not hasattr(obj, "shape") else obj.flat[0]
        if hasattr(obj, "shape"):
            obj.flat[0] = old + 1
        else:
            obj[0] = old + 1
        assert e.check_verbose() == "contents"
        if hasattr(obj, "shape"):
            obj.flat[0] = old
        else:
            obj[0] = old
        assert e.check_verbose() is None      # restored: holds again
    if isinstance(obj, bytearray):
        obj.append(0)                          # same prefix, longer
        assert e.check_verbose() == "contents"
        del obj[-1]
        assert e.check_verbose() is None


def test_bytes_guard_sees_a_reshape_and_a_dtype_view():
    import numpy as np
    from nnscaler_eval.guarding.state_guards import VG_BYTES
    a = np.arange(6, dtype="int32")
    holder = {"a": a}
    e = _value_entry((VG_BYTES, a))
    with warnings.catch_warnings():            # NumPy 2.5 deprecates these in-place edits
        warnings.simplefilter("ignore", DeprecationWarning)
        a.shape = (2, 3)                       # same bytes, other shape
        assert e.check_verbose() == "contents"
        a.shape = (6,)
        assert e.check_verbose() is None
        a.dtype = np.float32                   # same bytes, other format
        assert e.check_verbose() == "contents"
    assert holder


def test_bytes_guard_refuses_what_it_cannot_compare():
    import numpy as np
    from nnscaler_eval.guarding.state_guards import VG_BYTES
    with pytest.raises(TypeError, match="objects"):
        _value_entry((VG_BYTES, np.array([object()], dtype=object)))
    with pytest.raises(TypeError, match="buffer"):
        _value_entry((VG_BYTES, [1, 2]))


class _Slotted:
    __slots__ = ("a", "__b")

    def __init__(self):
        self.a = 1
        self.__b = "x"


def test_slots_guard_reads_the_slots_where_they_live():
    from nnscaler_eval.guarding.state_guards import VG_SLOTS
    obj = _Slotted()
    marker = object()
    e = _value_entry((VG_SLOTS, obj, ("a", "_Slotted__b"), (1, "x"), MISSING))
    assert e.check_verbose() is None
    obj.a = 2
    assert e.check_verbose() == "contents"
    obj.a = 1
    assert e.check_verbose() is None
    del obj.a                                  # unset slot: "absent", not the old value
    assert e.check_verbose() == "contents"
    e2 = _value_entry((VG_SLOTS, obj, ("a",), (MISSING,), MISSING))
    assert e2.check_verbose() is None
    obj.a = marker
    assert e2.check_verbose() == "contents"


def test_slots_guard_follows_the_class_and_dies_with_its_values():
    from nnscaler_eval.guarding.state_guards import VG_SLOTS

    class Other:
        __slots__ = ("a", "_Slotted__b")

    class Value:
        pass

    obj, value = _Slotted(), Value()
    obj.a = value
    e = _value_entry((VG_SLOTS, obj, ("a",), (value,), MISSING))
    assert e.check_verbose() is None
    obj.__class__ = Other                      # same layout, another class
    assert e.check_verbose() == "contents"
    obj.__class__ = _Slotted
    assert e.check_verbose() is None
    ref = weakref.ref(value)
    obj.a = None
    del value
    gc.collect()
    assert ref() is None
    assert e.check_verbose() == "contents"     # its value died: can never hold again


def test_slots_guard_refuses_names_that_are_not_object_slots():
    from nnscaler_eval.guarding.state_guards import VG_SLOTS
    with pytest.raises(TypeError, match="not a slot"):
        _value_entry((VG_SLOTS, _Slotted(), ("missing_name",), (1,), MISSING))
    with pytest.raises(TypeError, match="not a slot"):
        _value_entry((VG_SLOTS, _Slotted(), ("__b",), ("x",), MISSING))   # unmangled


def test_bytes_and_slots_guards_do_not_leak():
    """Made, checked (holding and failing) and freed many times: the snapshots, the
    slot offsets and the weakly held expected values go with each entry."""
    import numpy as np
    from leakcheck import assert_flat
    from nnscaler_eval.guarding.state_guards import VG_BYTES, VG_SLOTS
    arrays = [np.arange(64, dtype="float32").reshape(8, 8)[:, ::2], bytearray(b"abc")]
    holder = _Slotted()

    def workload():
        for i in range(2000):
            value = _Slotted()   # no __weakref__ slot: the guard holds it strongly
            holder.a = i % 3
            entry = _C.CacheEntry(None, [], [], ["b", "s"], {"info": 1}, [
                (VG_BYTES, arrays[i % 2]),
                (VG_SLOTS, holder, ("a", "_Slotted__b"), (1, value), MISSING)])
            entry.check_verbose()
            try:
                _C.CacheEntry(None, [], [], ["s"], {"info": 1},
                              [(VG_SLOTS, holder, ("a", "nope"), (1, 2), MISSING)])
            except TypeError:
                pass

    assert_flat(workload)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="__buffer__ in Python is 3.12+")
@pytest.mark.parametrize("meddle", ["drop references and collect", "mutate", "collect"])
def test_bytes_guard_survives_python_in_the_buffer_export(meddle):
    """The Python side never guards a buffer exported by Python code; the C guard
    still holds what it reads when such an exporter runs Python in the middle of the
    check: drops the entry's last other reference and collects, changes its bytes."""
    from nnscaler_eval.guarding.state_guards import VG_BYTES
    actions = []

    class Exporter:
        def __init__(self) -> None:
            self.data = bytearray(b"abcd")

        def __buffer__(self, flags):
            if actions:
                actions.pop()()
            return memoryview(self.data)

    obj = Exporter()
    entries = [_value_entry((VG_BYTES, obj))]
    entry = entries[0]
    assert entry.check_verbose() is None
    if meddle == "drop references and collect":
        actions.append(lambda: (entries.clear(), gc.collect()))
        assert entry.check_verbose() is None
    elif meddle == "mutate":
        actions.append(lambda: obj.data.__setitem__(0, 0x7a))
        assert entry.check_verbose() == "contents"
    else:
        actions.append(gc.collect)
        assert entry.check_verbose() is None
    del entry
    gc.collect()
