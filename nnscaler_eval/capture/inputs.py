"""Which arguments can be graph inputs, and what their placeholders are called.

A tensor leaf of the frame's argument slots (pytree containers looked into) is a
placeholder, and so are the tensors of a KV cache passed in (capture/passed_objects.py);
a leaf that is some other object carrying tensors cannot be one: the frame falls back,
known before anything runs (`input_fallback`).
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from nnscaler_eval.capture.calls import LITERAL_TYPES
from nnscaler_eval.capture.results import Fallback
from nnscaler_eval.guarding import keyed_objects


def holds_tensor(obj: Any, depth: int = 0, seen: Optional[set[int]] = None) -> bool:
    """Does a non-pytree object carry tensors, at any depth of its attributes, lists,
    tuples and dicts (an HF `DynamicCache` holds them in a list of layer objects)?
    Modules, functions, classes and Python modules are not looked into."""
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 8 or isinstance(obj, (*LITERAL_TYPES, nn.Module, type, types.FunctionType,
                                     types.ModuleType, types.MethodType)):
        return False
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, (tuple, list, set, frozenset)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, dict):
            return False
        items = attributes.values()
    return any(holds_tensor(item, depth + 1, seen) for item in list(items))


def hidden_tensors(leaf: Any) -> bool:
    """A pytree leaf that carries tensors the graph could not take as inputs."""
    return (not isinstance(leaf, (torch.Tensor, *LITERAL_TYPES, nn.Module))
            and not keyed_objects.is_keyed(leaf) and holds_tensor(leaf))


def hidden_tensors_reason(slot_name: str, leaf: Any) -> str:
    return (f"input {slot_name!r} holds tensors inside a {type(leaf).__name__}, which is "
            "not a pytree container (register it with torch.utils._pytree)")


def input_fallback(fn: Callable[..., Any], slots: tuple[Any, ...],
                   slot_names: tuple[str, ...]) -> Optional[tuple[Fallback, type]]:
    """Why these arguments cannot be graph inputs (tensors inside non-pytree objects,
    such as an HF KV cache), found before anything runs, with the type of the object
    at fault; None when they can."""
    for slot, slot_name in zip(slots, slot_names):
        for leaf in pytree.tree_leaves(slot):
            if hidden_tensors(leaf):
                code = getattr(fn, "__code__", None)
                where = (code.co_filename, code.co_firstlineno) if code else ("<unknown>", 0)
                return Fallback(hidden_tensors_reason(slot_name, leaf), *where), type(leaf)
    return None


def key_suffix(key: Any) -> str:
    """The part of a placeholder's name for one pytree key (`x_0`, `batch_ids`)."""
    if isinstance(key, pytree.SequenceKey):
        return f"_{key.idx}"
    if isinstance(key, pytree.MappingKey):
        return f"_{key.key}"
    if isinstance(key, pytree.GetAttrKey):
        return f"_{key.name}"
    return "_"
