"""Objects passed in that the per-call key names by their contents: transformers KV caches.

`generate()` makes a new cache object per call and the decode steps pass it back in,
grown by one token.  Keyed by identity (what the key does for an arbitrary object),
every call would miss.  Instances of the classes registered here are keyed by their
type and their instance `__dict__`, by value (`guards/call_key.c`, TAG_STRUCT): the
tensors they hold are described like tensor arguments (and become graph inputs), their
plain attributes by value.  The capture replays what the forward writes into them
(`capture/object_writes.py`).

Only transformers' cache classes qualify (`kv_cache_class`): an arbitrary object may
hold state its `__dict__` does not show (C fields, `__slots__`), or be relied on by
identity elsewhere.  A class is registered when a miss first meets one of its
instances (`register_in`); the key of that miss is then built again.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

from nnscaler_eval import _C

_registered: tuple[type, ...] = ()
_MAX_CLASSES = 32   # guards/call_key.h, CALL_KEY_MAX_STRUCT_TYPES
_WALK_DEPTH = 8     # guards/call_key.c keys by value to this depth


def kv_cache_class(cls: type) -> bool:
    """A transformers cache class (`Cache` or `CacheLayerMixin`) whose instances are
    their `__dict__`: no `__slots__`, no `__new__` of its own."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return False
    bases = tuple(getattr(cache_utils, name) for name in ("Cache", "CacheLayerMixin")
                  if isinstance(getattr(cache_utils, name, None), type))
    return (bool(bases) and issubclass(cls, bases) and cls.__new__ is object.__new__
            and not any(vars(c).get("__slots__") for c in cls.__mro__[:-1]))


def is_keyed(value: Any) -> bool:
    """Does the key describe `value` by its contents (a registered class)?"""
    return type(value) in _registered


def registered() -> tuple[type, ...]:
    return _registered


def _cache_objects(value: Any, depth: int, seen: set[int]) -> Iterable[Any]:
    if depth > _WALK_DEPTH or id(value) in seen:
        return
    seen.add(id(value))
    if type(value) in (list, tuple):
        items: Iterable[Any] = value
    elif type(value) is dict:
        items = list(value.values())
    elif isinstance(getattr(value, "__dict__", None), dict) and kv_cache_class(type(value)):
        yield value
        items = list(vars(value).values())
    else:
        return
    for item in items:
        yield from _cache_objects(item, depth + 1, seen)


def register_in(values: Iterable[Any]) -> bool:
    """Register the cache classes of the objects in `values` (arguments, looked into
    through lists, tuples, dicts and caches).  True when a class was added: keys built
    before describe such objects by identity and must be built again."""
    global _registered
    found = [type(obj) for value in values for obj in _cache_objects(value, 0, set())]
    new = tuple(dict.fromkeys(c for c in found if c not in _registered))
    if not new:
        return False
    classes = (_registered + new)[-_MAX_CLASSES:]
    _C.set_key_struct_types(classes)
    _registered = classes
    return True
