"""A state-mutation fuzzer: eager is the oracle for every change of state a forward can
reach.

For a model factory and its inputs, `fuzz()` builds two twins with equal state, one
eager and one compiled, calls both, then enumerates what is reachable from the model
(attributes, containers, submodules, parameters and buffers), from the globals and
closure cells its forwards name (and from there on, as deep as `depth`, beyond the
state walk's own bound), and from the arguments.  It changes one thing at a time
(rebinds a value, sets or deletes an item, appends to a list or a module container,
replaces a function or a submodule, changes a class attribute, edits a tensor or an
array in place), on both twins where the thing is the twin's own and once where it is
shared, calls both, and requires equal results: a recapture or an eager run is fine,
a stale hit is a failure.  Then it reverts the change and checks again.  A change that
makes eager raise is skipped (the compiled twin must raise too).

    .venv/bin/python tests/state_fuzz.py [--mutations 3000] [--models all] [--seed 0]

`make fuzz-state` runs it long; tests/test_state_fuzz.py runs it in the suite.
"""
from __future__ import annotations

import argparse
import array
import copy
import os
import dataclasses
import random
import sys
import time
import types
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

import nnscaler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle import same as _same  # noqa: E402

_PLAIN_NUMBERS = (int, float)
_SKIP_ATTRIBUTES = frozenset({"training", "_forward_hooks", "_forward_pre_hooks",
                              "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
                              "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                              "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs",
                              "_forward_hooks_always_called", "_non_persistent_buffers_set",
                              "_is_full_backward_hook", "_compiled_call_impl",
                              "_nnscaler_region_caches", "__class__", "__dict__"})


@dataclasses.dataclass
class Mutation:
    """One change: `apply()` makes it and returns the undo, or None if it cannot be
    made on this object; `label` says what it changed."""

    label: str
    apply: Callable[[], Optional[Callable[[], None]]]


# Differences that are not stale hits, documented in README.md ("Limits"): under the
# compile-safe paths transformers builds an explicit causal mask where eager passes
# none and relies on each attention module's `is_causal`; set to False on a causal
# model after the capture, the capture keeps the mask (torch.compile's answer too).
KNOWN = ("self_attn.is_causal",)


@dataclasses.dataclass
class Report:
    tried: int = 0
    skipped: int = 0            # the change could not be made
    raised: int = 0             # eager raised after the change (the compiled twin too)
    hits: int = 0               # calls of the compiled twin served from its cache
    stale: list[str] = dataclasses.field(default_factory=list)
    known: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        return (f"{self.tried} mutations tried, {self.skipped} skipped, {self.raised} "
                f"raised in both, {self.hits} hits, {len(self.stale)} stale, "
                f"{len(self.known)} known differences")


def _other_number(value: Any, rng: random.Random) -> Any:
    if type(value) is bool:
        return not value
    if type(value) is int:
        return value + rng.choice((1, 2, -1))
    return value * rng.choice((0.5, 2.0)) + 0.25


def _wrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    def other(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        return result * 2 if isinstance(result, torch.Tensor) else result
    other.__name__ = getattr(fn, "__name__", "other")
    return other


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


class _Enumerator:
    """Walks what is reachable and lists the mutations of each place found."""

    def __init__(self, rng: random.Random, depth: int, limit: int) -> None:
        self.rng = rng
        self.depth = depth
        self.limit = limit
        self.seen: set[int] = set()
        self.places: list[tuple[str, list[Any], Callable[[list[Any]], list[Mutation]]]] = []
        self.environment: set[str] = set()   # variable names code that reads os names

    # A place is found on the eager twin by a path of steps; `resolve` follows it on
    # any root.  Each step: ("attr", name), ("item", key), ("cell", index).
    def walk(self, obj: Any, path: list[Any], label: str, depth: int) -> None:
        if depth > self.depth or len(self.seen) >= self.limit or id(obj) in self.seen:
            return
        if isinstance(obj, (type(None), bool, int, float, str, bytes, torch.dtype,
                            torch.device, types.BuiltinFunctionType, type)):
            return
        self.seen.add(id(obj))
        if isinstance(obj, types.ModuleType):
            return   # a module's globals: reached as globals of the functions named
        if isinstance(obj, torch.Tensor):
            self.places.append((label, path, _tensor_mutations))
            return
        if isinstance(obj, nn.Module):
            self.places.append((label, path, _module_mutations))
            for name, value in list(obj.__dict__.items()):
                if name in _SKIP_ATTRIBUTES:
                    continue
                if name in ("_parameters", "_buffers", "_modules"):
                    for key, item in list(value.items()):
                        if item is not None:
                            self.walk(item, path + [("attr", name), ("item", key)],
                                      f"{label}.{key}", depth + 1)
                    continue
                self.places.append((f"{label}.{name}", path + [("attr", name)], _value_mutations))
                self.walk(value, path + [("attr", name)], f"{label}.{name}", depth + 1)
            self._class(type(obj), label, depth)
            return
        if isinstance(obj, list):
            self.places.append((label, path, _list_mutations))
            for i, item in enumerate(list(obj)):
                self.places.append((f"{label}[{i}]", path + [("item", i)], _value_mutations))
                self.walk(item, path + [("item", i)], f"{label}[{i}]", depth + 1)
            return
        if isinstance(obj, dict):
            self.places.append((label, path, _dict_mutations))
            for key, item in list(obj.items()):
                if isinstance(key, str) and key.startswith("__"):
                    continue
                self.places.append((f"{label}[{key!r}]", path + [("item", key)], _value_mutations))
                self.walk(item, path + [("item", key)], f"{label}[{key!r}]", depth + 1)
            return
        if isinstance(obj, tuple):
            for i, item in enumerate(obj):
                self.walk(item, path + [("item", i)], f"{label}[{i}]", depth + 1)
            return
        if isinstance(obj, types.FunctionType):
            for i, cell in enumerate(obj.__closure__ or ()):
                try:
                    content = cell.cell_contents
                except ValueError:
                    continue
                self.places.append((f"{label}.<cell {i}>", path + [("cell", i)], _value_mutations))
                self.walk(content, path + [("cell", i)], f"{label}.<cell {i}>", depth + 1)
            return
        if type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):
            self.places.append((label, path, _array_mutations))
            return
        if isinstance(obj, (bytearray, array.array)):
            self.places.append((label, path, _bytes_mutations))
            return
        for klass in type(obj).__mro__:
            slots = klass.__dict__.get("__slots__", ())
            for name in ((slots,) if isinstance(slots, str) else slots):
                if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                    self.places.append((f"{label}.{name}", path + [("attr", name)],
                                        _value_mutations))
        namespace = getattr(obj, "__dict__", None)
        if type(namespace) is dict:
            for name, value in list(namespace.items()):
                if name.startswith("__"):
                    continue
                self.places.append((f"{label}.{name}", path + [("attr", name)], _value_mutations))
                self.walk(value, path + [("attr", name)], f"{label}.{name}", depth + 1)

    def _class(self, cls: type, label: str, depth: int) -> None:
        for klass in cls.__mro__:
            if klass.__module__.startswith(("torch", "builtins", "transformers")):
                continue
            for name, value in list(vars(klass).items()):
                if isinstance(value, _PLAIN_NUMBERS):
                    self.places.append((f"class {klass.__qualname__}.{name}",
                                        [("class", klass), ("attr", name)], _value_mutations))
            for fn in vars(klass).values():
                if isinstance(fn, types.FunctionType):
                    self.globals_of(fn, depth)

    def globals_of(self, fn: types.FunctionType, depth: int) -> None:
        """The globals `fn` names (and attributes of modules it names, one level)."""
        scope = fn.__globals__
        names: set[str] = set()
        stack = [fn.__code__]
        while stack:
            code = stack.pop()
            names.update(code.co_names)
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        module = scope.get("__name__", "?")
        for name in sorted(names):
            if name not in scope:
                continue
            value = scope[name]
            path = [("globals", scope), ("item", name)]
            if isinstance(value, types.ModuleType):
                if value is os:
                    self.environment.update(
                        c for code in _codes(fn.__code__) for c in code.co_consts
                        if isinstance(c, str) and c.isidentifier() and c.isupper())
                    continue
                if value.__name__.startswith(("numpy", "math", "sys", "builtins")):
                    continue
                for attr in sorted(names):
                    if attr in getattr(value, "__dict__", {}) and not attr.startswith("__"):
                        self.places.append((f"{value.__name__}.{attr}",
                                            [("globals", value.__dict__), ("item", attr)],
                                            _value_mutations))
                continue
            self.places.append((f"global {module}.{name}", path, _value_mutations))
            self.walk(value, path, f"global {module}.{name}", depth + 1)


def _resolve(root: Any, path: list[Any]) -> Any:
    obj = root
    for kind, key in path:
        if kind == "attr":
            obj = obj.__dict__[key] if key in getattr(obj, "__dict__", {}) else getattr(obj, key)
        elif kind == "item":
            obj = obj[key]
        elif kind == "cell":
            obj = obj.__closure__[key].cell_contents
        elif kind in ("globals", "class"):
            obj = key
    return obj


def _parent_and_key(root: Any, path: list[Any]) -> tuple[Any, tuple[str, Any]]:
    return _resolve(root, path[:-1]), path[-1]


def _get(parent: Any, step: tuple[str, Any]) -> Any:
    kind, key = step
    if kind == "attr":
        return parent.__dict__[key] if key in getattr(parent, "__dict__", {}) else getattr(parent, key)
    if kind == "item":
        return parent[key]
    return parent.__closure__[key].cell_contents


def _set(parent: Any, step: tuple[str, Any], value: Any) -> None:
    kind, key = step
    if kind == "attr":
        if isinstance(parent, type) or isinstance(parent, nn.Module) or \
                key not in getattr(parent, "__dict__", {}):
            setattr(parent, key, value)
        else:
            parent.__dict__[key] = value
    elif kind == "item":
        parent[key] = value
    else:
        parent.__closure__[key].cell_contents = value


# -- mutations of each kind of place: functions of the places on both twins ----------
# Each takes the list of (root-resolved) targets, one per twin, or one if shared, and
# returns mutations that change all of them the same way.


def _value_mutations(targets: list[Any]) -> list[Mutation]:
    """Rebind a value (targets: (parent, step) pairs)."""
    parent, step = targets[0]
    try:
        value = _get(parent, step)
    except Exception:
        return []
    rng = random.Random(hash(str(step)) & 0xFFFF)
    if isinstance(value, _PLAIN_NUMBERS):
        new: Any = _other_number(value, rng)
    elif type(value) is tuple and value and all(isinstance(v, _PLAIN_NUMBERS) for v in value):
        new = (_other_number(value[0], rng),) + value[1:]
    elif isinstance(value, types.FunctionType) or isinstance(value, types.BuiltinFunctionType):
        new = _wrapped(value)
    elif isinstance(value, nn.Module):
        new = None   # submodules: _module_mutations replaces them with a twin-safe copy
    else:
        new = None
    if new is None:
        return []

    def apply() -> Optional[Callable[[], None]]:
        olds = []
        for p, s in targets:
            olds.append(_get(p, s))
            _set(p, s, new)

        def undo() -> None:
            for (p, s), old in zip(targets, olds):
                _set(p, s, old)
        return undo
    return [Mutation(f"rebind to {new!r}"[:80], apply)]


def _tensor_mutations(targets: list[Any]) -> list[Mutation]:
    def edit(change: Callable[[torch.Tensor], bool]) -> Callable[[], Optional[Callable[[], None]]]:
        def apply() -> Optional[Callable[[], None]]:
            saved = []
            with torch.no_grad():
                for t in targets:
                    if t.numel() == 0 or not change(t.detach().clone()):
                        return None
                for t in targets:
                    saved.append(t.detach().clone())
                    change(t)

            def undo() -> None:
                with torch.no_grad():
                    for t, old in zip(targets, saved):
                        t.copy_(old)
            return undo
        return apply

    def add_half(t: torch.Tensor) -> bool:
        if not t.is_floating_point():
            return False
        t.add_(0.5)
        return True

    def shrink_counts(t: torch.Tensor) -> bool:
        # Lengths, counts, indices: every value above 1 one less (still valid where
        # the old values were); a mask: flipped.  Shapes that come from the data move.
        if t.dtype == torch.bool:
            t.logical_not_()
            return True
        if t.is_floating_point() or t.is_complex() or not bool((t > 1).any()):
            return False
        t.sub_((t > 1).to(t.dtype))
        return True
    return [Mutation("edit in place (add_ 0.5)", edit(add_half)),
            Mutation("edit in place (counts one less, masks flipped)", edit(shrink_counts))]


def _array_mutations(targets: list[Any]) -> list[Mutation]:
    def apply() -> Optional[Callable[[], None]]:
        saved = [a.copy() for a in targets]
        for a in targets:
            if a.size == 0 or a.dtype.kind not in "fiu":
                return None
            a.flat[0] = a.flat[0] + 1

        def undo() -> None:
            for a, old in zip(targets, saved):
                a[...] = old
        return undo
    return [Mutation("numpy array edited in place", apply)]


def _bytes_mutations(targets: list[Any]) -> list[Mutation]:
    def apply() -> Optional[Callable[[], None]]:
        if not len(targets[0]):
            return None
        saved = [b[0] for b in targets]
        for b in targets:
            b[0] = (b[0] + 1) % 100
        return lambda: [b.__setitem__(0, v) for b, v in zip(targets, saved)]
    return [Mutation("edited in place", apply)]


def _environment_mutations(name: str) -> list[Mutation]:
    def apply() -> Optional[Callable[[], None]]:
        old = os.environ.get(name)
        os.environ[name] = "3" if old != "3" else "2"

        def undo() -> None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        return undo
    return [Mutation(f"os.environ[{name!r}] set", apply)]


def _list_mutations(targets: list[Any]) -> list[Mutation]:
    if not targets[0]:
        return []

    def append() -> Optional[Callable[[], None]]:
        for lst in targets:
            lst.append(copy.copy(lst[-1]))
        return lambda: [lst.pop() for lst in targets]

    def delete() -> Optional[Callable[[], None]]:
        saved = [lst.pop() for lst in targets]
        return lambda: [lst.append(v) for lst, v in zip(targets, saved)]

    def reverse() -> Optional[Callable[[], None]]:
        for lst in targets:
            lst.reverse()
        return lambda: [lst.reverse() for lst in targets]
    return [Mutation("list append", append), Mutation("list pop", delete),
            Mutation("list reverse", reverse)]


def _dict_mutations(targets: list[Any]) -> list[Mutation]:
    if not targets[0]:
        return []

    def delete() -> Optional[Callable[[], None]]:
        key = next(reversed(targets[0]))
        saved = [d.pop(key) for d in targets]

        def undo() -> None:
            for d, v in zip(targets, saved):
                d[key] = v
        return undo

    def add() -> Optional[Callable[[], None]]:
        key = next(reversed(targets[0]))
        new_key = f"{key}_fuzz" if isinstance(key, str) else None
        if new_key is None:
            return None
        for d in targets:
            d[new_key] = copy.copy(d[key])
        return lambda: [d.pop(new_key) for d in targets]
    return [Mutation("dict pop last key", delete), Mutation("dict new key", add)]


def _fresh_copy(module: nn.Module, seed: int) -> nn.Module:
    other = copy.deepcopy(module)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in list(other.parameters()) + list(other.buffers()):
            if p.is_floating_point():
                p.add_(torch.rand(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    return other


def _module_mutations(targets: list[Any]) -> list[Mutation]:
    module = targets[0]
    out: list[Mutation] = []

    def flip() -> Optional[Callable[[], None]]:
        for m in targets:
            m.training = not m.training
        return lambda: [setattr(m, "training", not m.training) for m in targets]
    out.append(Mutation("flip training", flip))
    if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module):
        def append() -> Optional[Callable[[], None]]:
            for m in targets:
                m.append(_fresh_copy(m[-1], 1))
            return lambda: [m.__delitem__(-1) for m in targets]

        def replace() -> Optional[Callable[[], None]]:
            saved = [m[0] for m in targets]
            for m in targets:
                m[0] = _fresh_copy(m[0], 2)

            def undo() -> None:
                for m, old in zip(targets, saved):
                    m[0] = old
            return undo
        out += [Mutation("module container append", append),
                Mutation("module container slot replaced", replace)]
    if isinstance(module, nn.ModuleDict) and len(module):
        def add() -> Optional[Callable[[], None]]:
            key = list(module.keys())[-1]
            for m in targets:
                m[f"{key}_fuzz"] = _fresh_copy(m[key], 3)
            return lambda: [m.pop(f"{key}_fuzz") for m in targets]
        out.append(Mutation("module dict new key", add))
    for name, child in list(module._modules.items()):
        if child is None:
            continue

        def swap(name: str = name) -> Optional[Callable[[], None]]:
            saved = [m._modules[name] for m in targets]
            for m in targets:
                m._modules[name] = _fresh_copy(m._modules[name], 4)

            def undo() -> None:
                for m, old in zip(targets, saved):
                    m._modules[name] = old
            return undo
        out.append(Mutation(f"submodule {name} replaced", swap))
    return out


def _targets(place_path: list[Any], roots: list[Any], kind: Callable[..., Any]) -> list[Any]:
    """The place on each root: both twins' own objects, or one shared object."""
    shared = place_path and place_path[0][0] in ("globals", "class")
    chosen = roots[:1] if shared else roots
    found: list[Any] = []
    for root in chosen:
        if kind is _value_mutations:
            parent, step = _parent_and_key(root, place_path)
            found.append((parent, step))
        else:
            found.append(_resolve(root, place_path))
    # a place both twins reach as one object (a shared function, a config) is
    # changed once
    if kind is _value_mutations:
        if len(found) == 2 and found[0][0] is found[1][0]:
            found = found[:1]
    elif len(found) == 2 and found[0] is found[1]:
        found = found[:1]
    return found


def fuzz(make_model: Callable[[], nn.Module], make_inputs: Callable[[], tuple[tuple, dict]],
         mutations: int, seed: int = 0, depth: int = 12, name: str = "model",
         log: Callable[[str], None] = lambda s: None, only: str = "") -> Report:
    """Fuzz one model (see the module docstring).  Unless it is one of RUNS_EAGERLY, its
    second call with unchanged state must hit: a model that always ran eagerly would
    agree with eager and prove nothing of the cache."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    eager = make_model()
    ours = make_model()
    ours.load_state_dict(eager.state_dict())
    compiled = nnscaler.compile(ours)
    args, kwargs = make_inputs()
    report = Report()

    def call(model: Any) -> tuple[bool, Any]:
        torch.manual_seed(1234)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return True, model(*args, **kwargs)
        except Exception as exc:   # eager's error is the oracle's answer too
            return False, type(exc)

    def agree(stage: str, label: str) -> Optional[bool]:
        """True when both agree, None when both raise the same error (eager's error is
        the answer; the compiled twin must give it too), False for a stale answer."""
        ok_e, want = call(eager)
        ok_c, got = call(compiled)
        if not ok_e:
            if not ok_c and got is want:
                return None
            report.stale.append(f"{name}: {label} ({stage}): eager raised {want.__name__}, "
                                f"compiled {'returned' if ok_c else 'raised ' + got.__name__}")
            log(f"STALE {report.stale[-1]}")
            return False
        if not ok_c or not _same(got, want):
            if ok_c and any(k in label for k in KNOWN):
                report.known.append(f"{name}: {label} ({stage})")
                return True
            report.stale.append(f"{name}: {label} ({stage})")
            detail = got if not ok_c else nnscaler.cache_info(compiled)
            log(f"STALE {name}: {label} ({stage}): {detail}")
            return False
        return True

    for _ in range(2):
        if agree("before any change", "nothing changed") is None:
            raise RuntimeError(f"{name}: eager raises on the inputs given")
    start_hits = nnscaler.cache_info(compiled).hits
    enumerator = _Enumerator(rng, depth, limit=4000)
    enumerator.walk(eager, [], "self", 0)
    # Library code is trusted for what it reads of its own state (nn.Linear's F.linear):
    # the globals of the forwards torch does not define.
    for fn in {type(m).forward for m in eager.modules() if isinstance(
            getattr(type(m), "forward", None), types.FunctionType)}:
        if type(fn.__globals__.get("__name__", "")) is not str or \
                not fn.__globals__.get("__name__", "").startswith("torch."):
            enumerator.globals_of(fn, 0)
    for i, value in enumerate(args):
        enumerator.walk(value, [("args", i)], f"args[{i}]", 0)
    candidates: list[tuple[str, Mutation]] = []
    for label, path, kind in enumerator.places:
        try:
            if path and path[0][0] == "args":
                targets_: list[Any] = [args[path[0][1]]]
                rest = path[1:]
                if kind is _value_mutations:
                    if not rest:
                        continue
                    targets_ = [_parent_and_key(targets_[0], rest)]
                else:
                    targets_ = [_resolve(targets_[0], rest)]
            else:
                targets_ = _targets(path, [eager, ours], kind)
        except Exception:
            continue
        for mutation in kind(targets_):
            if any(part in f"{label}: {mutation.label}" for part in only.split("|")):
                candidates.append((label, mutation))
    for variable in sorted(enumerator.environment):
        candidates += [(f"os.environ[{variable!r}]", m) for m in _environment_mutations(variable)
                       if only in f"os.environ[{variable!r}]: {m.label}"]
    rng.shuffle(candidates)
    for label, mutation in candidates[:mutations]:
        what = f"{label}: {mutation.label}"
        try:
            undo = mutation.apply()
        except Exception:
            undo = None
        if undo is None:
            report.skipped += 1
            continue
        report.tried += 1
        if os.environ.get("NNSCALER_FUZZ_VERBOSE"):
            log(f"try {what}")
        try:
            if agree("after the change", what) is None:
                report.raised += 1
        finally:
            undo()
        agree("after reverting it", what)
    report.hits = nnscaler.cache_info(compiled).hits
    if start_hits == 0 and name not in RUNS_EAGERLY:
        # The second identical call ran eagerly: the fuzzer would prove nothing of the
        # cache (a model that always runs eagerly agrees with eager).
        report.stale.append(f"{name}: the second call with the same state did not hit "
                            f"({nnscaler.cache_info(compiled)})")
    return report


# -- the models it runs on -------------------------------------------------------------


# Models whose root runs eagerly by design (a shape from data that Python reads): the
# fuzzer checks that no change of their state makes them hit stale instead.
RUNS_EAGERLY = frozenset({"packed_lstm", "masked_lengths"})


def _own_models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]]:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import models as m
    return {
        "block": (lambda: m.Block().eval(), lambda: ((torch.randn(2, 5, 32),), {})),
        "convbn": (lambda: m.ConvBN().eval(), lambda: ((torch.randn(2, 3, 8, 8),), {})),
        "branchy": (m.Branchy, lambda: ((torch.randn(4, 4),), {})),
        "value_only": (m.ValueOnly, lambda: ((torch.randn(4, 4),), {})),
        "timm_like": (TimmLike, lambda: ((torch.randn(2, 3, 16, 16),), {})),
        # shapes from data: a lengths tensor decides them
        "packed_lstm": (PackedLSTM, lambda: ((torch.randn(3, 6, 4), torch.tensor([6, 4, 3])),
                                             {})),
        "masked_lengths": (MaskedLengths, lambda: ((torch.randn(3, 6, 4),
                                                    torch.tensor([6, 4, 3])), {})),
    }


class PackedLSTM(nn.Module):
    """An LSTM over `pack_padded_sequence`: the output's length is `lengths.max()`."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 3, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, _ = self.lstm(packed)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]


class MaskedLengths(nn.Module):
    """A mask from lengths cuts the padding off, and picks the real tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> Any:
        mask = torch.arange(int(x.shape[1]))[None, :] < lengths[:, None]
        longest = torch.arange(lengths.max())
        tokens = self.proj(x)[:, :longest.shape[0]][mask[:, :longest.shape[0]]]
        return tokens, tokens.shape[0]


class _Mlp(nn.Module):
    def __init__(self, d: int, ratio: float = 2.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, int(d * ratio))
        self.act = nn.GELU()
        self.fc2 = nn.Linear(int(d * ratio), d)
        self.drop_rate = 0.0

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Attention(nn.Module):
    fused_attn = True

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.scale = (d // heads) ** -0.5
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused_attn:
            x = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            x = ((q * self.scale) @ k.transpose(-2, -1)).softmax(-1) @ v
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class _ViTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = _Attention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = _Mlp(d)
        self.ls = [1.0, 1.0]   # layer-scale factors, read per call

    def forward(self, x):
        x = x + self.ls[0] * self.attn(self.norm1(x))
        return x + self.ls[1] * self.mlp(self.norm2(x))


class TimmLike(nn.Module):
    """timm's shape: a patch stem, blocks in a Sequential, config read in forward."""

    def __init__(self, d: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, 4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.blocks = nn.Sequential(*[_ViTBlock(d, 2) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 5)
        self.global_pool = "token"
        self.cfg = {"pool_scale": 1.0, "extra_tokens": 1}

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.norm(self.blocks(x))
        x = x[:, 0] if self.global_pool == "token" else x.mean(1)
        return self.head(x) * self.cfg["pool_scale"]


def _hf_models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]]:
    try:
        import transformers
    except ImportError:
        return {}
    transformers.logging.set_verbosity_error()

    def gpt2() -> nn.Module:
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=32, use_cache=False)
        return transformers.GPT2LMHeadModel(cfg).eval()
    def llama() -> nn.Module:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, max_position_embeddings=32,
                                       use_cache=False)
        return transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    return {"hf_gpt2": (gpt2, lambda: ((), {"input_ids": ids})),
            "hf_llama": (llama, lambda: ((), {"input_ids": ids}))}


def _given_models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]]:
    """The forwards of tests/test_state_reads.py: each reads one kind of state."""
    import test_state_reads as t
    x = lambda: ((torch.randn(3, 4),), {})   # noqa: E731
    return {
        "containers": (t.Stack, x),
        "other_module": (t.UsesHelper, x),
        "fileless_module": (t.UsesFileless, x),
        "torch_functions": (t.UsesTorchFunctions, x),
        "environment": (t.ReadsTheEnvironment, x),
        "partial": (t.UsesPartial, x),
        "no_dict_version": (t.ReadsMutableObjects, x),
        "computed_names": (_ComputedNames, x),
    }


class _ComputedNames(nn.Module):
    """Attributes read by names built at run time, through getattr, hasattr, vars()."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.kind = "relu"
        self.scale_relu, self.scale_gelu = 2.0, 3.0
        self.shift_relu, self.shift_gelu = 0.5, -0.5

    def forward(self, x):
        y = self.proj(x) * getattr(self, "scale_" + self.kind)
        if hasattr(self, "extra_" + self.kind):
            y = y + 1
        return y + vars(self)["shift_" + self.kind]


def all_models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]]:
    return {**_own_models(), **_given_models(), **_hf_models()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mutations", type=int, default=3000, help="per model")
    parser.add_argument("--models", default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="mutations whose label contains this")
    options = parser.parse_args()
    models = all_models()
    names = list(models) if options.models == "all" else options.models.split(",")
    total = Report()
    for name in names:
        make, inputs = models[name]
        start = time.perf_counter()
        report = fuzz(make, inputs, options.mutations, options.seed, name=name, log=print,
                      only=options.only)
        print(f"{name}: {report} in {time.perf_counter() - start:.1f} s")
        total.tried += report.tried
        total.skipped += report.skipped
        total.raised += report.raised
        total.hits += report.hits
        total.stale += report.stale
        total.known += report.known
    print(f"all: {total}")
    sys.exit(1 if total.stale else 0)


if __name__ == "__main__":
    main()
