"""Objects passed in that the per-call key names by their contents: transformers KV
caches, transformers `ModelOutput`s and dataclasses.

`generate()` makes a new cache object per call and the decode steps pass it back in,
grown by one token; an encoder-decoder's `generate()` passes the encoder's output to
every decoder step in a `BaseModelOutput`.  Keyed by identity (what the key does for an
arbitrary object), every new object would miss, and the tensors inside would be state
read through an argument rather than inputs.  Instances of the classes registered here
are keyed by their type and their instance `__dict__`, by value (`guards/call_key.c`,
TAG_STRUCT): the tensors they hold are described like tensor arguments (and become graph
inputs), their plain attributes by value.  The capture replays what the forward writes
into them (`capture/passed_objects.py`).

Which classes qualify (`keyed_class`): those whose instances are their `__dict__`, so
that the key sees all of their state: transformers' cache classes, and dataclasses
without `__slots__` made by `object.__new__`; and transformers' `ModelOutput`s, which
are dataclasses and ordered dicts whose items mirror their fields.  Any other object
may hold state its `__dict__` does not show (C fields, `__slots__`, dict items), or be
relied on by identity elsewhere.  A class is registered when a miss first meets one of
its instances (`register_in`); the key of that miss is then built again.
"""

from __future__ import annotations

import dataclasses
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


def model_output_class(cls: type) -> bool:
    """A transformers `ModelOutput` subclass (a dataclass and an OrderedDict whose
    items are its fields that are not None)."""
    generic = sys.modules.get("transformers.utils.generic")
    base = getattr(generic, "ModelOutput", None)
    return isinstance(base, type) and issubclass(cls, base)


def value_class(cls: type) -> bool:
    """A dataclass whose instances are their `__dict__` (no `__slots__`, made by
    `object.__new__`), or a transformers ModelOutput."""
    if not dataclasses.is_dataclass(cls) or \
            any(vars(c).get("__slots__") for c in cls.__mro__[:-1]):
        return False
    if issubclass(cls, dict):
        return model_output_class(cls)
    return cls.__new__ is object.__new__ and not issubclass(cls, (tuple, list, set))


def keyed_class(cls: type) -> bool:
    """Are instances of `cls` keyed by their contents (see the module docstring)?"""
    return kv_cache_class(cls) or value_class(cls)


def is_keyed(value: Any) -> bool:
    """Does the key describe `value` by its contents (a registered class)?"""
    return type(value) in _registered


def registered() -> tuple[type, ...]:
    return _registered


def _keyed_objects(value: Any, depth: int, seen: set[int]) -> Iterable[Any]:
    if depth > _WALK_DEPTH or id(value) in seen:
        return
    seen.add(id(value))
    if type(value) in (list, tuple):
        items: Iterable[Any] = value
    elif type(value) is dict:
        items = list(value.values())
    elif isinstance(getattr(value, "__dict__", None), dict) and keyed_class(type(value)):
        yield value
        items = list(vars(value).values())
    else:
        return
    for item in items:
        yield from _keyed_objects(item, depth + 1, seen)


def holds_kv_cache(value: Any) -> bool:
    """Does an argument hold a KV cache (as itself, or through lists, tuples, dicts and
    keyed objects)?"""
    return any(kv_cache_class(type(obj)) for obj in _keyed_objects(value, 0, set()))


def register_in(values: Iterable[Any]) -> bool:
    """Register the keyed classes of the objects in `values` (arguments, looked into
    through lists, tuples, dicts and keyed objects).  True when a class was added: keys built
    before describe such objects by identity and must be built again."""
    global _registered
    found = [type(obj) for value in values for obj in _keyed_objects(value, 0, set())]
    new = tuple(dict.fromkeys(c for c in found if c not in _registered))
    if not new:
        return False
    classes = (_registered + new)[-_MAX_CLASSES:]
    _C.set_key_struct_types(classes)
    _registered = classes
    return True
