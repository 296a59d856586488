"""KV caches passed in: their tensors as graph inputs, and what the forward writes into
them replayed by the runner.

A decoder's forward takes the cache (`past_key_values`), calls `cache.update(k, v, i)`,
and the layer replaces its tensors (`self.keys = torch.cat([self.keys, k], -2)`,
`index_copy_` into a static buffer, a sliding window's crop) and plain attributes
(`is_initialized`, `cumulative_length`).  The call key describes such an object by its
contents (`guarding/keyed_objects.py`), so:

- its tensors, found through its `__dict__` and the lists, tuples and dicts in it, are
  placeholders reached by attribute paths (`past_key_values.layers[0].keys`);
- everything else in it is in the key by value: what the forward reads of it is
  covered without a guard;
- what the forward changed in it (`ObjectSnapshot.writes`) is laid out as writes: an
  attribute set to a graph output, a constant, an object passed in, or an object built
  anew per call (`output.object_shape`); an attribute deleted; a list's or dict's items
  replaced.  The runner performs them after the graph, as eager's forward left the
  object.  In-place ops on its tensors are graph ops already.

A write the runner cannot perform (an attribute set to an arbitrary object) makes the
capture uncacheable (`ObjectSnapshot.writes` says why).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils._pytree as pytree

from nnscaler_eval.guarding.keyed_objects import is_keyed

_MISSING: Any = object()
_MAX_DEPTH = 8


def _inside(value: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
    """(path, leaf) below a keyed object's attribute value."""
    if is_keyed(value):
        for name, item in list(vars(value).items()):
            yield from _inside(item, path + (pytree.GetAttrKey(name),))
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            yield from _inside(item, path + (pytree.SequenceKey(i),))
    elif type(value) is dict:
        for k, item in list(value.items()):
            yield from _inside(item, path + (pytree.MappingKey(k),))
    else:
        yield path, value


def input_leaves(slot: Any) -> list[tuple[tuple, Any]]:
    """The leaves of an argument as pytree flattens them, a keyed object (a KV cache)
    looked into: its tensors are leaves too, with attribute paths."""
    out: list[tuple[tuple, Any]] = []
    for keys, leaf in flatten(slot):
        if is_keyed(leaf):
            out.extend(_inside(leaf, tuple(keys)))
        else:
            out.append((tuple(keys), leaf))
    return out


def holds_keyed(value: Any) -> bool:
    """Does an argument hold a keyed object (as itself, or as a pytree leaf)?"""
    return is_keyed(value) or any(is_keyed(leaf) for _, leaf in flatten(value))


def flatten(value: Any) -> list[tuple[Any, Any]]:
    """pytree's (path, leaf) pairs of an argument, stopping at keyed objects (a
    ModelOutput is a pytree node too: its attributes are what the key describes)."""
    return pytree.tree_flatten_with_path(value, is_leaf=is_keyed)[0]


def resolve(value: Any, keys: tuple) -> Any:
    """The value at pytree `keys` below `value` (attributes, items)."""
    for key in keys:
        if isinstance(key, pytree.GetAttrKey):
            value = vars(value)[key.name]
        elif isinstance(key, pytree.SequenceKey):
            value = value[key.idx]
        elif isinstance(key, pytree.MappingKey):
            value = value[key.key]
        else:
            raise TypeError(f"no such step: {key!r}")
    return value


def copy_with(value: Any, replace: Callable[[tuple, Any], Any], path: tuple = (),
              memo: Optional[dict[int, Any]] = None) -> Any:
    """A copy of an argument in which every keyed object (and the lists, tuples and
    dicts on the way to one or inside one) is a new object of the same class and
    contents, and each leaf is `replace(path, leaf)`: a symbolic capture runs on such
    copies, so what the forward writes into the cache lands in the copy.  An object
    met twice (one cache passed as two arguments: share `memo` across them) is copied
    once, so the copies alias as the originals do."""
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    if is_keyed(value):
        cls = type(value)
        copy = memo[id(value)] = cls.__new__(cls)
        copy.__dict__.update({name: copy_with(item, replace,
                                              path + (pytree.GetAttrKey(name),), memo)
                              for name, item in vars(value).items()})
        if isinstance(value, dict):
            # a ModelOutput: its items are its fields that are not None
            put = (collections.OrderedDict.__setitem__
                   if isinstance(copy, collections.OrderedDict) else dict.__setitem__)
            for name in list(value):
                put(copy, name, copy.__dict__.get(name, value[name]))
        return copy
    if type(value) in (list, dict) and path:
        copy = memo[id(value)] = [] if type(value) is list else {}
        if type(value) is list:
            copy.extend(copy_with(item, replace, path + (pytree.SequenceKey(i),), memo)
                        for i, item in enumerate(value))
        else:
            copy.update({k: copy_with(item, replace, path + (pytree.MappingKey(k),), memo)
                         for k, item in value.items()})
        return copy
    if type(value) is tuple and path:
        return tuple(copy_with(item, replace, path + (pytree.SequenceKey(i),), memo)
                     for i, item in enumerate(value))
    if path and isinstance(value, torch.Tensor):
        # one tensor at two paths (an alias in the key: only its first is a field)
        copy = memo[id(value)] = replace(path, value)
        return copy
    if path and isinstance(value, int | float):
        return replace(path, value)
    if not path:
        # a top-level argument: pytree containers are looked into for keyed objects
        leaves, spec = pytree.tree_flatten_with_path(value, is_leaf=is_keyed)
        if not any(is_keyed(leaf) for _, leaf in leaves):
            return value
        return pytree.tree_unflatten(
            [copy_with(leaf, replace, tuple(keys), memo) if is_keyed(leaf)
             else replace(tuple(keys), leaf) for keys, leaf in leaves], spec)
    return value


class ObjectSnapshot:
    """The state of the keyed objects an argument list holds, before the forward ran:
    each object's attributes, and the items of each list and dict inside one."""

    def __init__(self, slots: tuple) -> None:
        # id -> (object, (slot, pytree keys), contents before)
        self.objects: dict[int, tuple[Any, tuple[int, tuple], dict]] = {}
        self.containers: dict[int, tuple[Any, tuple[int, tuple], Any]] = {}
        for index, slot in enumerate(slots):
            for keys, leaf in flatten(slot):
                if is_keyed(leaf):
                    self._take(leaf, (index, tuple(keys)), 0)

    def _take(self, value: Any, where: tuple[int, tuple], depth: int) -> None:
        if depth > _MAX_DEPTH or id(value) in self.objects or id(value) in self.containers:
            return
        slot, keys = where
        if is_keyed(value):
            contents = dict(vars(value))
            self.objects[id(value)] = (value, where, contents)
            items = [(pytree.GetAttrKey(n), v) for n, v in contents.items()]
        elif type(value) is list:
            self.containers[id(value)] = (value, where, list(value))
            items = [(pytree.SequenceKey(i), v) for i, v in enumerate(value)]
        elif type(value) is dict:
            self.containers[id(value)] = (value, where, dict(value))
            items = [(pytree.MappingKey(k), v) for k, v in value.items()]
        elif type(value) is tuple:
            items = [(pytree.SequenceKey(i), v) for i, v in enumerate(value)]
        else:
            return
        for key, item in items:
            self._take(item, (slot, keys + (key,)), depth + 1)

    def __bool__(self) -> bool:
        return bool(self.objects)

    def where(self, value: Any) -> Optional[tuple[int, tuple]]:
        """Where an object passed in sits in the arguments, or None."""
        known = self.objects.get(id(value)) or self.containers.get(id(value))
        return known[1] if known is not None and known[0] is value else None

    def writes(self, shape_of: Callable[[Any], Optional[tuple]]
               ) -> tuple[list[tuple], Optional[str]]:
        """What the forward changed, as writes the runner performs: ("set", where,
        name, shape), ("del", where, name), ("items", where, shape) with `shape` from
        `shape_of` (output.object_shape, objects passed in named by where they sit);
        or the reason one cannot be replayed."""
        out: list[tuple] = []
        for value, where, before in self.objects.values():
            now = vars(value)
            for name in list(dict.fromkeys([*before, *now])):
                old, new = before.get(name, _MISSING), now.get(name, _MISSING)
                if new is old:
                    continue
                if isinstance(value, dict):
                    return [], (f"the forward changed {type(value).__name__}.{name} of an "
                                "argument (its items too), which the runner does not replay")
                if new is _MISSING:
                    out.append(("del", where, name))
                    continue
                shape = shape_of(new)
                if shape is None:
                    return [], (f"the forward set {type(value).__name__}.{name} of an "
                                f"argument to a {type(new).__name__}, which the runner "
                                "cannot rebuild")
                out.append(("set", where, name, shape))
        for value, where, before in self.containers.values():
            same = (len(value) == len(before) and all(
                a is b for a, b in zip(value, before))) if type(value) is list else (
                value.keys() == before.keys() and all(value[k] is before[k] for k in value))
            if same:
                continue
            shape = shape_of(list(value) if type(value) is list else dict(value))
            if shape is None:
                return [], (f"the forward changed the items of a {type(value).__name__} "
                            "inside an argument's cache into values the runner cannot "
                            "rebuild")
            out.append(("items", where, shape))
        return out, None


def _words(shape: tuple, slot_names: tuple) -> str:
    kind = shape[0]
    if kind == "graph":
        return f"graph output {shape[1]}"
    if kind == "constant":
        return repr(shape[1])
    if kind == "input":
        return path_words(shape[1].slot, shape[1].keys, slot_names)
    if kind in ("list", "tuple"):
        items = ", ".join(_words(s, slot_names) for s in shape[1])
        return f"[{items}]" if kind == "list" else f"({items})"
    if kind == "dict":
        return "{" + ", ".join(f"{k!r}: {_words(s, slot_names)}" for k, s in shape[1]) + "}"
    return f"new {shape[1].__name__}"


def path_words(slot: int, keys: tuple, slot_names: tuple) -> str:
    """`cache.layers[0].keys`: an argument and pytree keys below it."""
    text = slot_names[slot] if slot < len(slot_names) else f"#{slot}"
    for key in keys:
        text += (f".{key.name}" if isinstance(key, pytree.GetAttrKey) else
                 f"[{key.idx}]" if isinstance(key, pytree.SequenceKey) else f"[{key.key!r}]")
    return text


def describe_writes(writes: tuple, slot_names: tuple) -> list[str]:
    """A layout's writes in words, one line each (explain)."""
    lines = []
    for kind, where, *rest in writes:
        target = path_words(where.slot, where.keys, slot_names)
        if kind == "del":
            lines.append(f"del {target}.{rest[0]}")
        elif kind == "set":
            lines.append(f"{target}.{rest[0]} = {_words(rest[1], slot_names)}")
        else:
            lines.append(f"{target}[:] = {_words(rest[0], slot_names)}")
    return lines
