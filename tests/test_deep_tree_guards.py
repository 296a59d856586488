"""Writes into the guarded dicts of a deep module tree, made directly (no
nn.Module.__setattr__, no register_*), after a capture: every one must make the
compiled call return what eager returns (docs/design.md, "Guards", item 3).

On 3.11 the dict guards of an entry are checked by one sum of version tags while
none moved (compat_objects.h, NNS_DICT_TAGS_MONOTONIC), with the owners' class and
__dict__ checked first; on 3.12+ by the dict clock.  Each write below touches one
dict of one module in the middle of the tree (or nothing a version shows: a
replaced __dict__, a changed class), so a check that skipped any kind of guarded
dict, or the owners' checks, returns the stale graph's result.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

import nnscaler
from nnscaler_eval import _C
from nnscaler_eval.guarding.state_guards import MISSING, VG_DICT

DEPTH = 7   # blocks: with the root and the list, more dicts than one unrolled step


class Block(nn.Module):
    shift = 0.0   # a class attribute an instance value shadows

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.scale = 1.0
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x):
        return self.act(self.lin(x)) * self.scale + self.offset + self.shift


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class OtherBlock(Block):
    def forward(self, x):
        return super().forward(x) - 5.0


class Shifted(Block):
    shift = 3.0


def _double(module, args, output):
    return output * 2


def _negate_input(module, args):
    return (-args[0],)


def _add_to_weight(m):
    with torch.no_grad():
        p = nn.Parameter(m.blocks[3].lin.weight + 1.0)
    m.blocks[3].lin._parameters["weight"] = p


def _replace_dict(m):
    block = m.blocks[3]
    fresh = dict(block.__dict__)
    fresh["scale"] = -1.0
    block.__dict__ = fresh


WRITES = {
    "instance dict value": lambda m: m.blocks[3].__dict__.__setitem__("scale", 3.0),
    "instance dict key shadowing the class": lambda m: m.blocks[3].__dict__.__setitem__(
        "shift", 2.0),
    "_modules item": lambda m: m.blocks[3]._modules.__setitem__("act", nn.Tanh()),
    "_modules of the list": lambda m: m.blocks._modules.__setitem__("3", Block()),
    "_modules del": lambda m: m.blocks._modules.__delitem__(str(DEPTH - 1)),
    "_parameters item": _add_to_weight,
    "_buffers item": lambda m: m.blocks[3]._buffers.__setitem__("offset", torch.ones(4)),
    "_forward_hooks item": lambda m: m.blocks[3]._forward_hooks.__setitem__(10**6, _double),
    "_forward_pre_hooks item": lambda m: m.blocks[3].lin._forward_pre_hooks.__setitem__(
        10**6, _negate_input),
    "global forward hooks": lambda m: torch.nn.modules.module._global_forward_hooks.__setitem__(
        10**6, _double),
    "__dict__ replaced": _replace_dict,
    "__class__ assigned": lambda m: setattr(m.blocks[3], "__class__", OtherBlock),
    "__class__ assigned (class attribute)": lambda m: setattr(m.blocks[3], "__class__", Shifted),
}


@pytest.fixture(autouse=True)
def _no_global_hooks_left():
    yield
    torch.nn.modules.module._global_forward_hooks.pop(10**6, None)


def _eager(m, x):
    with torch.no_grad():
        return m._call_impl(x)


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
def test_direct_write_into_a_guarded_dict_is_seen(write):
    torch.manual_seed(0)
    m = nnscaler.compile(Deep())
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):   # captured, then hits
            torch.testing.assert_close(m(x), _eager(m, x))
        before = m(x)
        WRITES[write](m)
        want = _eager(m, x)
        assert not torch.allclose(want, before), "the write should change eager's result"
        for _ in range(2):
            torch.testing.assert_close(m(x), want)


def test_a_deleted_instance_value_falls_back_to_the_class():
    m = nnscaler.compile(Deep())
    x = torch.randn(2, 4)
    with torch.no_grad():
        m(x)
        m(x)
        m.blocks[2].__dict__["shift"] = 1.5
        torch.testing.assert_close(m(x), _eager(m, x))
        del m.blocks[2].__dict__["shift"]   # the class's 0.0 again
        torch.testing.assert_close(m(x), _eager(m, x))
        Block.shift = 0.25   # the class dict
        try:
            torch.testing.assert_close(m(x), _eager(m, x))
        finally:
            Block.shift = 0.0


def test_unrelated_writes_then_a_relevant_one():
    """A dict that moved without changing what was read re-validates (no recapture);
    the next relevant write is still seen (the sum compared with is the new one)."""
    m = nnscaler.compile(Deep())
    x = torch.randn(2, 4)
    with torch.no_grad():
        m(x)
        for i in range(4):
            m.blocks[i].counter = i               # a name the forward never reads
            m.blocks[i]._forward_hooks[5] = _double
            del m.blocks[i]._forward_hooks[5]     # back as it was: same entries
            torch.testing.assert_close(m(x), _eager(m, x))
        assert nnscaler.cache_info(m).captures == 1
        m.blocks[5].__dict__["scale"] = 0.5
        torch.testing.assert_close(m(x), _eager(m, x))
        assert nnscaler.cache_info(m).captures == 2
        m.blocks[5].__dict__["scale"] = 1.0   # back: the first entry holds again
        torch.testing.assert_close(m(x), _eager(m, x))
        assert nnscaler.cache_info(m).captures == 2


def test_a_guarded_module_dies():
    m = nnscaler.compile(Deep())
    x = torch.randn(2, 4)
    with torch.no_grad():
        m(x)
        m(x)
        old = weakref.ref(m.blocks[4])
        m.blocks._modules["4"] = Block()   # the old block goes
        gc.collect()
        assert old() is None
        torch.testing.assert_close(m(x), _eager(m, x))


# ---- the C entry directly: many dicts, some reached through their owners ----

class Owner:
    pass


def _entry(dicts, owners=()):
    specs = [(VG_DICT, d, tuple(d), tuple(d.values()), MISSING, None, True) for d in dicts]
    specs += [(VG_DICT, o.__dict__, ("a",), (o.__dict__["a"],), MISSING, o, None)
              for o in owners]
    names = [f"dict {i}" for i in range(len(dicts))] + [f"owner {i}" for i in range(len(owners))]
    return _C.CacheEntry(None, [], [], names, {}, specs)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 9, 64])
def test_every_dict_of_many_is_looked_at(n):
    """Each position of the packed loop (the unrolled steps and the tail) and each
    owner: a write to any one dict fails the entry, a write back holds again."""
    dicts = [{"k": i} for i in range(n)]
    owners = [Owner() for _ in range(n)]
    for i, o in enumerate(owners):
        o.a = i
    e = _entry(dicts, owners)
    assert e.check_verbose() is None
    for i in range(n):
        dicts[i]["k"] = -1
        assert e.check_verbose() == f"dict {i}"
        dicts[i]["k"] = i
        assert e.check_verbose() is None
        owners[i].a = -1
        assert e.check_verbose() == f"owner {i}"
        owners[i].a = i
        assert e.check_verbose() is None
        dicts[i]["k"] = i   # moved, same value: re-validated, holds
        owners[i].b = 0     # a name not guarded: re-validated, holds
        assert e.check_verbose() is None


@pytest.mark.parametrize("change", ["dict replaced", "class changed", "owner died"])
def test_owner_checks_come_before_the_dict_is_read(change):
    """A replaced __dict__, a changed class, a dead owner: none moves the guarded
    dict's version (the old dict may even be freed), each must fail."""
    class Other(Owner):
        pass

    owners = [Owner() for _ in range(6)]
    for o in owners:
        o.a = 1
    e = _entry([{"k": 0}] * 5, owners)
    assert e.n_held_owners == 0   # held by nothing guarded: read through weakrefs
    assert e.check_verbose() is None
    if change == "dict replaced":
        owners[3].__dict__ = {"a": 1}    # the same contents, another dict
        gc.collect()                     # the old one freed
        assert e.check_verbose() == "owner 3"
    elif change == "class changed":
        owners[3].__class__ = Other
        assert e.check_verbose() == "owner 3"
        owners[3].__class__ = Owner      # back: holds again
        assert e.check_verbose() is None
    else:
        owners[3] = None
        gc.collect()
        assert e.check_verbose() == "owner 3"


# ---- owners a guarded dict holds (a child under its parent's `_modules`) ----

def _held_entry(n):
    """n owners, each the value of a dict the entry guards directly (its "holder"),
    then the owners' __dict__ guards: the hit path reads these owners without their
    weakrefs while the holders are unchanged (cache_entry.h, OwnerCheck.held)."""
    owners = [Owner() for _ in range(n)]
    for i, o in enumerate(owners):
        o.a = i
    holder = {f"m{i}": o for i, o in enumerate(owners)}
    return owners, holder, _entry([holder], owners)


HELD_CHANGES = ["replaced in the holder", "deleted from the holder", "class changed",
                "__dict__ replaced", "its dict written", "holder written back"]


@pytest.mark.parametrize("change", HELD_CHANGES)
@pytest.mark.parametrize("at", [0, 2, 4])
def test_an_owner_a_guarded_dict_holds(change, at):
    """An owner read without its weakref must still fail every way it can: taken out
    of its holder and freed (its memory reused by an object of the same class with a
    dict at the same place, as far as the allocator allows), its class or __dict__
    replaced, its dict written; and a holder written back to the same owners holds."""
    class Other(Owner):
        pass

    owners, holder, e = _held_entry(5)
    assert e.n_held_owners == 5
    assert e.check_verbose() is None
    assert e.check_verbose() is None   # the second check is the one the clock vouches
    key = f"m{at}"
    if change in ("replaced in the holder", "deleted from the holder"):
        if change == "replaced in the holder":
            holder[key] = Owner()
        else:
            del holder[key]
        owners[at] = None
        gc.collect()
        reused = [Owner() for _ in range(64)]   # likely to take the freed memory
        for o in reused:
            o.a = at
        assert e.check_verbose() == "dict 0"
        assert e.check_verbose() == "dict 0"   # and stays failed: the owner is dead
    elif change == "class changed":
        owners[at].__class__ = Other
        assert e.check_verbose() == f"owner {at}"
        owners[at].__class__ = Owner
        assert e.check_verbose() is None
    elif change == "__dict__ replaced":
        owners[at].__dict__ = {"a": at}
        gc.collect()
        assert e.check_verbose() == f"owner {at}"
    elif change == "its dict written":
        owners[at].a = -1
        assert e.check_verbose() == f"owner {at}"
        owners[at].a = at
        assert e.check_verbose() is None
    else:
        holder[key] = owners[at]           # moved, same owner: re-validated, holds
        assert e.check_verbose() is None
        owners[at].__class__ = Other       # then read through the holder again
        assert e.check_verbose() == f"owner {at}"


def test_children_removed_from_a_compiled_tree_and_freed():
    """The module-level case: blocks taken out of their ModuleList (no __setattr__),
    freed, and new blocks of the same class made in their place, more than once."""
    torch.manual_seed(0)
    m = nnscaler.compile(Deep())
    x = torch.randn(2, 4)
    with torch.no_grad():
        for round_ in range(3):
            m(x)
            m(x)
            (entry,) = [e for b in _C.code_state(Deep.forward.__code__)["buckets"]
                        if b.self is m for e in b.entries][:1]
            # every block, its lin and act, and the list: held by `_modules` dicts
            assert entry.n_held_owners == 3 * DEPTH + 1
            for i in range(DEPTH):
                m.blocks._modules[str(i)] = Block()
                m.blocks[i].scale = float(round_ + i)
            gc.collect()
            torch.testing.assert_close(m(x), _eager(m, x))
