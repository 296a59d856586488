"""The compat layer's version-neutral contracts (compat/compat.h), on whatever CPython
runs the tests: "dict changed since snapshot" numbers (ma_version_tag on 3.11, a dict
watcher on 3.12+) and frames the evaluator returns for without running them (cleared
and popped by us on 3.12+)."""
from __future__ import annotations

import gc
import threading
import weakref

import torch

import nnscaler
from nnscaler_eval import _C


def test_dict_version_stable_until_changed():
    d = {"a": 1}
    v = _C.dict_version(d)
    assert _C.dict_version(d) == v
    _ = d["a"], len(d), list(d)          # reads change nothing
    assert _C.dict_version(d) == v


def test_dict_version_changes_on_every_kind_of_change():
    d = {"a": 1}
    ops = [lambda: d.__setitem__("b", 2), lambda: d.__setitem__("a", 3),
           lambda: d.pop("b"), lambda: d.update(c=4), lambda: d.setdefault("e", 5),
           lambda: d.popitem(), lambda: d.clear(), lambda: d.__setitem__("f", 6),
           lambda: d.__delitem__("f")]
    seen = {_C.dict_version(d)}
    for op in ops:
        op()
        v = _C.dict_version(d)
        assert v not in seen, op
        seen.add(v)


def test_dict_version_of_a_new_dict_never_matches_an_old_snapshot():
    # a dict freed and another allocated at the same address must not look unchanged
    snapshots = {}
    for i in range(200):
        d = {"k": i}
        snapshots[id(d)] = _C.dict_version(d)
        del d
    for i in range(200):
        d = {"k": i}
        if id(d) in snapshots:
            assert _C.dict_version(d) != snapshots[id(d)]


def test_dict_version_sees_attribute_stores_through_instance_dicts():
    class Obj:
        pass

    o = Obj()
    o.x = 1
    v = _C.dict_version(o.__dict__)
    o.x = 2                               # not through the dict object itself
    assert _C.dict_version(o.__dict__) != v
    v = _C.dict_version(o.__dict__)
    del o.x
    assert _C.dict_version(o.__dict__) != v


class Site(torch.nn.Module):
    def forward(self, x):
        return x if self.training else x


def test_arguments_of_frames_run_in_their_place_are_released():
    # rewrite mode runs the rewritten code instead of the frame; the frame's own
    # references (its arguments) must still be dropped (3.12+: by the evaluator)
    class Arg:
        pass

    m = Site().train()
    arg = Arg()
    ref = weakref.ref(arg)
    with nnscaler.eval_frame.enable():
        for _ in range(3):
            assert m.forward(arg) is arg
    assert _C.code_state(Site.forward.__code__)["n_sites"] == 1
    del arg
    assert ref() is None, "an argument of a replaced frame is still referenced"


def test_replaced_frames_with_immortal_and_borrowed_arguments():
    # 3.14 tags stack references to immortal objects; the slots handed to the C
    # core must be the objects themselves
    def f(self, a, b=None, *args, k=True, **kw):
        return (a if self.training else b, args, k, kw)

    m = Site().eval()
    with nnscaler.eval_frame.enable():
        assert f(m, 1, None, 2, 3, k=False, z=0) == (None, (2, 3), False, {"z": 0})
        assert f(m.train(), 0, b=True) == (0, (), True, {})
        assert f(m, 0) == (0, (), True, {})
    assert _C.code_state(f.__code__)["n_sites"] == 1


def test_threads_each_clear_their_own_frames():
    errors = []

    def work():
        try:
            m = Site().train()
            with nnscaler.eval_frame.enable():
                for i in range(2000):
                    assert m.forward(i) == i
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert errors == []


def test_the_evaluator_reads_code_state_without_a_call():
    """csrc/code_state.c checks at import that co_extra is laid out as on every
    audited CPython (compat.h, nns_code_extra_read); were it not, the evaluator would
    fall back to CPython's getter on every frame, slower, and this test says so."""
    assert _C.CO_EXTRA_DIRECT == 1
