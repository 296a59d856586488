"""Guards on the Python state a capture read (docs/design.md, "Guards", kind 3: values).

A concrete trace sees values, not where they came from: `x * self.scale` records a
multiplication by 0.5, whatever `self.scale` is next time.  So every plain value the
forward could have read is guarded, and a change recaptures.  What "could have read"
means, concretely:

- the code objects that ran during the capture are recorded (`CodeRecorder`, a
  evaluator notes them on the capturing thread); the names they can look up as
  attributes or globals are their `co_names` (plus identifier-like string constants,
  for `getattr(self, "name")`).  That set filters every namespace below, so a write to
  an attribute no captured code names costs one re-validation, never a recapture;
- the namespaces: the `__dict__` of every module of the root's tree (torch layers'
  own settings included: `Dropout.p`, `LayerNorm.eps`), of every object reached from
  them, from the globals those names select, and from the arguments (config objects
  passed in), with the class dicts along the MRO for class attributes; the globals
  dict of each function that ran; closure cells of the functions that ran, and the
  code/defaults of functions reached; the items of lists and dicts reached.  Guarded as `(dict, keys, values)`
  with the dict's version: cheap while nothing moves, re-validated when it does;
- tensor metadata of parameters, buffers and constants, when the trace asked any
  tensor for metadata (a dtype or shape baked into the graph may come from them);
- global torch state (autocast per device, default dtype, deterministic algorithms,
  inference mode, ...): torch's own GlobalStateGuard, checked in C++.

The walk is bounded (depth and count); what lies beyond is listed by `explain()` as
not guarded.  It also finds what a replay cannot do: a forward that wrote to an
argument container or object, or to a global, and a tensor input that is also
reachable from state (a parameter passed as the input) are reported, so the caller
does not cache the capture.
"""
from __future__ import annotations

import array
import dis
import functools
import gc
import keyword
import os
import random
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn as nn

from nnscaler_eval import _C
from nnscaler_eval.guarding import keyed_objects
from nnscaler_eval.tracing.locations import is_library_file

MISSING = type("Missing", (), {"__repr__": lambda self: "<absent>"})()

# Spec kinds understood by guards/value_guards.c, which defines their numbers.
VG_DICT, VG_LIST, VG_CELL, VG_FUNCTION, VG_TENSOR, VG_CALL, VG_TENSORS, VG_BYTES, VG_SLOTS = (
    _C.VG_DICT, _C.VG_LIST, _C.VG_CELL, _C.VG_FUNCTION, _C.VG_TENSOR, _C.VG_CALL, _C.VG_TENSORS,
    _C.VG_BYTES, _C.VG_SLOTS)

# Bumped whenever nn.Module._apply runs (`.to()`, `.half()`, `.cuda()`, `.float()`...)
# or a tensor's `.data` is assigned (`param.data = other`): the ways torch changes
# parameters' dtype/device/shape in place without touching a module dict. Guards on
# the metadata of parameters, buffers and constants (VG_TENSORS) re-read them only
# when this dict's version moved.
APPLY_EPOCH: dict[str, int] = {"epoch": 0}
_torch_module_apply = nn.Module._apply


def _apply(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    try:
        return _torch_module_apply(self, *args, **kwargs)
    finally:
        APPLY_EPOCH["epoch"] += 1


_apply.__wrapped__ = _torch_module_apply  # type: ignore[attr-defined]
if getattr(nn.Module._apply, "__wrapped__", None) is not _torch_module_apply:
    nn.Module._apply = _apply  # type: ignore[method-assign]

# `Tensor.data` is a C getset of torch._C.TensorBase; torch.Tensor (a Python class)
# gets a property in front of it that does the same and moves the epoch on a set.
# torch looks the name up on torch.Tensor for __torch_function__ (its getter's
# `func`), so subclasses see this property's __get__ as they saw the getset's.
_tensor_base_data = torch._C.TensorBase.__dict__["data"]


def _get_data(self: torch.Tensor) -> torch.Tensor:
    return _tensor_base_data.__get__(self, type(self))


def _set_data(self: torch.Tensor, value: Any) -> None:
    try:
        _tensor_base_data.__set__(self, value)
    finally:
        APPLY_EPOCH["epoch"] += 1


if not isinstance(torch.Tensor.__dict__.get("data"), property):
    torch.Tensor.data = property(  # type: ignore[assignment]
        _get_data, _set_data, doc=_tensor_base_data.__doc__)

# nn.Module's own bookkeeping attributes: the module tree and hook dicts are guarded
# structurally (guard_builder); the others (state-dict hooks, ...) do not shape a
# forward. `training` is a graph input or a flag guard.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"training", "_compiled_call_impl",
                                                       "_nnscaler_region_caches"}

_TREE_DICTS = ("_modules", "_parameters", "_buffers")

MAX_DEPTH = 8
_CO_NEWLOCALS = 0x2
MAX_OBJECTS = 4096

_TORCH_NN_DIR = os.path.join("torch", "nn", "")

# Values that carry no state of their own (compared by value or immortal).
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.layout, torch.memory_format, type(Ellipsis), type(NotImplemented), range,
          slice)
# Objects whose state is not user state: never walked into.
_OPAQUE = (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
           types.MethodDescriptorType, types.MethodWrapperType, types.GetSetDescriptorType,
           types.MemberDescriptorType, types.CodeType, types.FrameType, weakref.ref,
           property, staticmethod, classmethod, torch._C._TensorMeta)


def _is_installed(code: types.CodeType) -> bool:
    return "-packages" + os.sep in code.co_filename


def _is_library_module(module: types.ModuleType) -> bool:
    name = getattr(module, "__name__", "") or ""
    if name.split(".", 1)[0] in ("torch", "nnscaler_eval", "builtins", "numpy"):
        return True
    filename = getattr(module, "__file__", None)
    return filename is None or is_library_file(filename)


def _is_stdlib_module(module: types.ModuleType) -> bool:
    filename = getattr(module, "__file__", None)
    if filename is None:
        return getattr(module, "__name__", "") in sys.builtin_module_names
    return filename.startswith(_STDLIB_DIR) and "-packages" not in filename


_STDLIB_DIR = os.path.join(os.path.dirname(functools.__file__), "")


def _is_library_class(cls: type) -> bool:
    module = sys.modules.get(getattr(cls, "__module__", None) or "")
    return module is None or _is_library_module(module)


def _is_library_function(fn: types.FunctionType) -> bool:
    """Library code: a library file's, or code a library module generated from a
    string (a dataclass's `__init__`, a namedtuple's `__new__`: filename `<string>`)
    whose globals are that module's own dict.  Generated code of the user's modules,
    and code exec'd with globals of its own, stays the user's."""
    filename = fn.__code__.co_filename
    if is_library_file(filename):
        return True
    if not filename.startswith("<"):
        return False
    module = sys.modules.get(fn.__globals__.get("__name__") or "")
    return (module is not None and getattr(module, "__dict__", None) is fn.__globals__
            and _is_library_module(module))


_NN_MODULE_FILE = os.path.join("torch", "nn", "modules", "module.py")


def _is_torch_layer(code: types.CodeType) -> bool:
    """Code of torch.nn's layers (not nn.Module's own machinery, whose globals are the
    hook registries guard_builder guards)."""
    filename = code.co_filename
    return _TORCH_NN_DIR in filename and not filename.endswith(_NN_MODULE_FILE)


def _names_of(code: types.CodeType) -> Iterable[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, str) and const.isidentifier() and not keyword.iskeyword(const):
            yield const


# Names through which user code can read an attribute or a namespace entry by a name
# computed at run time (`getattr(self, "scale_" + kind)`, `vars(self)[k]`), which
# neither co_names nor the constants show.  Where user code that ran uses one so
# (`reads_by_computed_name`), the namespaces the walk reaches are guarded whole
# (`_StateWalk.every_key`).  A getattr/hasattr call whose name is a string constant
# (`getattr(config, "use_cache", None)`, the common case) reads a name the constants
# show, and costs nothing more.  (Recording names as getattr runs would need
# builtins.getattr replaced for the length of a capture; libraries that snapshot
# the builtins meanwhile, Dynamo's trace rules on first use, keep the replacement.)
_NAME_READERS = frozenset({"getattr", "hasattr"})
_KEYED_READERS = _NAME_READERS | {"__dict__", "vars", "attrgetter", "methodcaller",
                                  "__getattribute__", "getattr_static"}
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs) | frozenset(getattr(dis, "hasjump", ()))
_CALLS = frozenset(dis.opmap[n] for n in ("CALL", "PRECALL") if n in dis.opmap)
_LOAD_CONST = dis.opmap["LOAD_CONST"]
_LOAD_GLOBAL = dis.opmap["LOAD_GLOBAL"]


@functools.lru_cache(maxsize=4096)
def reads_by_computed_name(code: types.CodeType) -> bool:
    """Whether `code` can read an attribute or namespace entry by a name computed at
    run time: it names one of _KEYED_READERS other than as the callee of a
    getattr/hasattr call whose name argument is a string constant.  Conservative:
    any use that straight-line bytecode does not show to be such a call counts."""
    if _KEYED_READERS.isdisjoint(code.co_names):
        return False
    if not (_KEYED_READERS - _NAME_READERS).isdisjoint(code.co_names):
        return True
    instructions = [ins for ins in dis.get_instructions(code) if ins.opname != "CACHE"]
    for i, ins in enumerate(instructions):
        if ins.argval in _NAME_READERS and ins.opname != "LOAD_CONST":
            if not _constant_name_call(instructions, i):
                return True
    return False


# Instructions that only work on the top of the stack, by how many values they
# push (what they pop is that less their stack effect): a getattr default may be
# made of these.
_PUSHES_ONE = frozenset(dis.opmap[n] for n in (
    "LOAD_CONST", "LOAD_FAST", "LOAD_FAST_BORROW", "LOAD_FAST_CHECK", "LOAD_DEREF",
    "LOAD_SMALL_INT", "LOAD_NAME", "BINARY_OP", "BINARY_SUBSCR", "CALL", "BUILD_TUPLE",
    "BUILD_LIST", "UNARY_NEGATIVE", "UNARY_NOT", "UNARY_INVERT", "PUSH_NULL",
    "LOAD_ATTR", "LOAD_GLOBAL") if n in dis.opmap)


def _pushes(ins: Any) -> int:
    """Values `ins` (one of _PUSHES_ONE) leaves on top."""
    if ins.opname in ("LOAD_GLOBAL", "LOAD_ATTR") and (ins.arg or 0) & 1 and (
            ins.opname == "LOAD_GLOBAL" or sys.version_info >= (3, 12)):
        return 2   # with a NULL or self for a call
    return 1


def _effect(ins: Any) -> int:
    return (dis.stack_effect(ins.opcode, ins.arg, jump=False)
            if ins.opcode >= dis.HAVE_ARGUMENT else dis.stack_effect(ins.opcode))


def _constant_name_call(instructions: list, start: int) -> bool:
    """The instruction at `start` loads getattr/hasattr as a global to call it, and
    the call it feeds, in straight-line code, is (obj, "name") or (obj, "name",
    default) with the name a string constant: the value pushed on top of
    (callable, NULL, obj) is a LOAD_CONST of a str, and nothing touches it before
    the call (the default is made of instructions that work on the top only)."""
    load = instructions[start]
    if load.opcode != _LOAD_GLOBAL or not (load.arg or 0) & 1:
        return False   # a value (`f = getattr`), an attribute, a local of that name
    depth = _effect(load)   # the callable and its NULL
    name_at = None          # the last instruction that took the depth from 3 to 4
    before: list[int] = []  # the depth before each instruction from `start` on
    for j in range(start + 1, len(instructions)):
        ins = instructions[j]
        if ins.opcode in _JUMPS or ins.is_jump_target:
            return False
        if ins.opcode in _CALLS and depth == 2 + (ins.arg or 0):
            break   # 3.11: its PRECALL, which comes first
        try:
            after = depth + _effect(ins)
        except ValueError:
            return False
        if after < 3 <= depth:
            return False   # the callable's first argument was consumed
        if (depth, after) == (3, 4):
            name_at = j
        before.append(depth)
        depth = after
    else:
        return False
    if (ins.arg or 0) not in (2, 3) or name_at is None:
        return False
    name = instructions[name_at]
    if name.opcode != _LOAD_CONST or not isinstance(name.argval, str):
        return False
    for k in range(name_at + 1, j):
        ins = instructions[k]
        # what it pops must leave the name (slot 4) alone
        if ins.opcode not in _PUSHES_ONE or before[k - start - 1] - (_pushes(ins) - _effect(ins)) < 4:
            return False
    return True


class CodeRecorder:
    """Records the functions that run on this thread while it is active.

    The frame evaluator notes each frame's function (csrc/frame_record.c): it sees
    every Python frame of the capture, the rewritten ones our evaluator runs and torch
    layers' forwards included, and it leaves the user's profiler (cProfile) alone.
    """

    def __init__(self) -> None:
        self.functions: list[types.FunctionType] = []
        self.codes: dict[int, types.CodeType] = {}
        # id(globals) -> (globals, names user code can read through it)
        self.globals: dict[int, tuple[dict, set[str]]] = {}
        self.complete = True
        self._token: Any = None

    def __enter__(self) -> "CodeRecorder":
        self._token = _C.record_functions_start()
        return self

    def __exit__(self, *exc: object) -> None:
        functions, complete = _C.record_functions_stop(self._token)
        self._token = None
        self.complete = bool(complete)
        for fn in functions:
            if not isinstance(fn, types.FunctionType):
                continue
            self.functions.append(fn)
            code = fn.__code__
            self.codes.setdefault(id(code), code)
            # torch.nn's layers too: what they look up in their own module's globals
            # (nn.Dropout's F.dropout) is what a user replacing F.dropout changes.
            if not _is_library_function(fn) or _is_torch_layer(code):
                scope = fn.__globals__
                entry = self.globals.setdefault(id(scope), (scope, set()))
                entry[1].update(code.co_names)

    def names(self) -> set[str]:
        """Names the code that ran can look up on user state: the user's code, installed
        packages, and torch.nn (layers read their own settings); not the rest of
        torch or our own code, which read no user attributes by name."""
        names: set[str] = set()
        for code in self.codes.values():
            filename = code.co_filename
            if is_library_file(filename) and _TORCH_NN_DIR not in filename:
                continue
            names.update(_names_of(code))
        return names

    def reads_keys_by_value(self) -> bool:
        """User code that ran can read a namespace by a name computed at run time
        (`getattr(self, prefix + kind)`, `vars(self)[k]`): see _KEYED_READERS."""
        return any(not is_library_file(code.co_filename) and reads_by_computed_name(code)
                   for code in self.codes.values())

    def user_functions(self) -> list[types.FunctionType]:
        """Functions of the user's code that ran and existed before the call (not the
        lambdas and nested functions the forward itself created)."""
        nested = {id(const) for code in self.codes.values() for const in code.co_consts
                  if isinstance(const, types.CodeType)}
        return [fn for fn in self.functions
                if not _is_library_function(fn) and id(fn.__code__) not in nested]

    def global_writes(self) -> list[str]:
        """Globals the user's code that ran can rebind or delete (STORE_GLOBAL /
        DELETE_GLOBAL in a function that ran: conservative, a conditional write counts)."""
        written: set[str] = set()
        for code in self.codes.values():
            # Installed packages (sympy, ...) cache lazily into their own globals,
            # which changes no result of the forward.
            if is_library_file(code.co_filename) or _is_installed(code):
                continue
            written.update(_stored_globals(code))
        return sorted(written)


_GLOBAL_STORES = {dis.opmap["STORE_GLOBAL"], dis.opmap["DELETE_GLOBAL"]}


def _stored_globals(code: types.CodeType) -> list[str]:
    raw = code.co_code
    if not any(raw[i] in _GLOBAL_STORES for i in range(0, len(raw), 2)):
        return []
    return [ins.argval for ins in dis.get_instructions(code) if ins.opcode in _GLOBAL_STORES]


def _real_dict(cls: type) -> Optional[dict]:
    """The dict behind `cls.__dict__` (a mappingproxy), whose version moves on writes."""
    referents = gc.get_referents(cls.__dict__)
    return referents[0] if len(referents) == 1 and isinstance(referents[0], dict) else None


@dataclass
class StateGuardSet:
    specs: list[tuple[Any, ...]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    state_tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    truncated: list[str] = field(default_factory=list)
    # state the capture could read that no guard can compare: the capture is not kept
    unguardable: list[str] = field(default_factory=list)

    def add(self, spec: tuple[Any, ...], name: str) -> None:
        self.specs.append(spec)
        self.names.append(name)


_ENVIRON_READERS = tuple(f for f in (getattr(os, "getenv", None), getattr(os, "getenvb", None))
                         if f is not None)
MAX_CONTENT_BYTES = 1 << 20


def _slot_names(cls: type) -> dict[str, str]:
    """The slots `cls` and its bases declare (instance attributes that live outside
    any `__dict__`): {name as code writes it: name of its member descriptor} (a
    private `__x` is stored mangled, `_Cls__x`)."""
    names: dict[str, str] = {}
    for klass in cls.__mro__:
        declared = klass.__dict__.get("__slots__", ())
        if isinstance(declared, str):
            declared = (declared,)
        for name in declared:
            if name in ("__dict__", "__weakref__"):
                continue
            stored = (f"_{klass.__name__.lstrip('_')}{name}"
                      if name.startswith("__") and not name.endswith("__") else name)
            names.setdefault(name, stored)
    # A class attribute of the same name, met first along the MRO, shadows the slot
    # (sympy's `One.p = 1` over Rational's slot `p`): reading it reads the class,
    # which visit_class guards.
    return {name: stored for name, stored in names.items()
            if type(_class_lookup(cls, stored)) is types.MemberDescriptorType}


def _class_lookup(cls: type, name: str) -> Any:
    """What attribute lookup finds for `name` along `cls`'s MRO, calling nothing."""
    for klass in cls.__mro__:
        namespace = klass.__dict__
        if name in namespace:
            return namespace[name]
    return MISSING


def _is_ndarray(value: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def _buffer_fallback(obj: Any) -> Optional[str]:
    """Why `obj`'s contents cannot be a VG_BYTES guard (too large, objects in it, a
    buffer that Python code exports), or None when they can: bytearrays,
    array.arrays and NumPy arrays, whose buffers C exports (a class's own
    `__buffer__` would run on every hit)."""
    if isinstance(obj, (bytearray, array.array)):
        size = len(obj) * obj.itemsize if isinstance(obj, array.array) else len(obj)
    elif _is_ndarray(obj):
        if obj.dtype.hasobject:
            return "it holds Python objects"
        size = obj.nbytes
    else:
        return "it has no bytes to compare"
    if any("__buffer__" in vars(k) for k in type(obj).__mro__
           if k.__module__ not in ("builtins", "array", "numpy")):
        return "its class exports the buffer in Python"
    if size > MAX_CONTENT_BYTES:
        return f"{size} bytes, more than the {MAX_CONTENT_BYTES} compared on each call"
    return None


def same_value(a: Any, b: Any, atoms: tuple[type, ...] = _ATOMS) -> bool:
    """Equal as a guard compares (value_guards.c's same_value): the same object, or
    values of the same exact type among `atoms`, and tuples of such (NaN never)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) is tuple:
        return len(a) == len(b) and all(same_value(x, y, atoms) for x, y in zip(a, b))
    return isinstance(a, atoms) and a == b


class _StateWalk:
    """Builds the value guards for one capture (see the module docstring)."""

    def __init__(self, names: set[str], labels: dict[int, str],
                 visited: Iterable[nn.Module] = (), every_key: bool = False) -> None:
        self.names = names
        # attribute namespaces guarded whole (CodeRecorder.reads_keys_by_value)
        self.every_key = every_key
        # modules the trace called: guard_builder guards their trees and hooks
        self.visited = {id(m) for m in visited}
        self.watched = frozenset(names)
        self._watched_sets: dict[frozenset, frozenset] = {frozenset(): self.watched}
        self.labels = labels
        self.out = StateGuardSet()
        self._seen: set[int] = set()
        # Dicts guarded so far, by id: the keys their guards cover, those with a guard
        # watching for new names, and those with a guard on all of their keys.
        self._keys: dict[int, set[Any]] = {}
        self._watching: set[int] = set()
        self._exact: set[int] = set()
        self._keep: list[Any] = []

    def _label(self, obj: Any, fallback: str) -> str:
        return self.labels.get(id(obj), fallback)

    def _watched_without(self, skipped: frozenset) -> frozenset:
        found = self._watched_sets.get(skipped)
        if found is None:
            found = self._watched_sets[skipped] = self.watched - skipped
        return found

    def guard_namespace(self, namespace: dict, label: str, depth: int,
                        names: Optional[Iterable[Any]] = None, skip: Iterable[str] = (),
                        owner: Any = None, exact: bool = False,
                        pinned: tuple[str, ...] = (), walk: bool = True,
                        attributes: str = "") -> None:
        """Guard `namespace[key]` for the keys captured code can read, and walk them.

        `names=None`: the names captured code can look up (attribute namespaces);
        otherwise exactly those keys (a plain dict: all of its keys).  Where user code
        can read namespaces by a computed key (`every_key`), `attributes` says how
        this one is guarded instead: "whole" (an object's or a module's: every key,
        a key added included), "class" (a user class's: the same, walking only the
        values of `names`), "present" (a Python module's: every key it holds, a
        library module gaining names as its submodules import; walking only the
        values of the names code reads)."""
        # A dict reached twice (a module's globals, as the scope of a function that
        # ran and as a module object user code reads attributes of) is guarded for
        # the union of what each way reads: a second guard takes the keys the first
        # did not cover.
        key = id(namespace)
        if key in self._exact:
            return
        walked: Optional[Iterable[Any]] = None   # all the guarded keys' values
        if self.every_key and attributes:
            if attributes == "class":
                # the class's own names read by name are walked as before; the rest
                # (its methods, mostly) only compared where they stand
                walked = set(names if names is not None else ())
            elif attributes == "present":
                # a Python module's values: those read by name walked as before, the
                # rest (its imports, functions, classes) compared where they stand
                walked = {k for k in namespace if isinstance(k, str) and k in self.names}
            else:
                # a module's internals (hook dicts, `training`) are compared, not
                # walked: guard_builder guards the hook dicts' contents
                walked = set(namespace) - set(skip)
            names, skip = list(namespace), ()
            exact = exact or attributes in ("whole", "class")
        covered = self._keys.setdefault(key, set())
        skipped = set(skip)
        if not exact:   # an exact guard checks every key, covered or not
            skipped |= covered
        watched: Optional[frozenset] = None
        if names is None:
            # the watched names it holds; the addition of another one is caught by the
            # watched set (keys absent now need no entry of their own)
            keys = tuple(k for k in namespace if isinstance(k, str) and k in self.names
                         and k not in skipped and k not in pinned)
            keys += tuple(k for k in pinned if k in namespace and k not in skipped)
            if key not in self._watching:
                watched = self._watched_without(frozenset(skipped))
                self._watching.add(key)
        else:
            keys = tuple(k for k in names if k not in skipped)
        if not keys and not exact and watched is None:
            return
        covered.update(keys)
        if exact:
            self._exact.add(key)
        values = tuple(namespace.get(k, MISSING) for k in keys)
        present = [(k, v) for k, v in zip(keys, values) if v is not MISSING]
        # With its owner, the guard holds the owner weakly and the dict not at all.
        self.out.add((VG_DICT, namespace, keys, values, MISSING, owner, True if exact else watched),
                     f"{label}: {len(present)} names read ({', '.join(str(k) for k, _ in present[:6])}"
                     f"{', ...' if len(present) > 6 else ''})")
        for key, value in present:
            if walk and key not in pinned and (walked is None or key in walked):
                self.visit(value, f"{label}.{key}", depth + 1)

    def visit(self, value: Any, label: str, depth: int) -> None:
        if isinstance(value, _ATOMS) or isinstance(value, _OPAQUE):
            return
        if isinstance(value, torch.Tensor):
            self.out.state_tensors[id(value)] = value
            return
        if id(value) in self._seen:
            return
        if depth > MAX_DEPTH or len(self._seen) >= MAX_OBJECTS:
            self.out.truncated.append(label)
            return
        self._seen.add(id(value))
        self._keep.append(value)
        if isinstance(value, nn.Module):
            self.visit_module(value, depth)
        elif type(value) is list:
            self.out.add((VG_LIST, value, tuple(value)), f"{label} (list of {len(value)})")
            for i, item in enumerate(value):
                self.visit(item, f"{label}[{i}]", depth + 1)
        elif isinstance(value, (tuple, frozenset)):
            for i, item in enumerate(value):
                self.visit(item, f"{label}[{i}]", depth + 1)
        elif type(value) is dict:
            self.guard_namespace(value, label, depth, names=list(value), exact=True)
        elif isinstance(value, types.FunctionType):
            self.visit_function(value, label, depth)
        elif isinstance(value, types.MethodType):
            self.visit(value.__func__, f"{label}.__func__", depth + 1)
            self.visit(value.__self__, f"{label}.__self__", depth + 1)
        elif isinstance(value, types.ModuleType):
            # A library module too (`F.gelu`, `torch.tanh`, `helpers.act` where
            # helpers has no file): the names the captured code reads through it;
            # a library module's own values are not walked further (library code is
            # trusted for what it reads of its own state).
            # A standard-library module is guarded for the names code reads, even where
            # user code reads names it computes: its other globals are its own running
            # state (`warnings.filters`, which every `catch_warnings()` block rebinds),
            # not what a forward is made of.
            self.guard_namespace(value.__dict__, f"module {value.__name__}", depth,
                                 walk=not _is_library_module(value),
                                 attributes="" if _is_stdlib_module(value) else "present")
            if value is os:
                self.guard_environ(depth)
        elif value is os.environ or any(value is f for f in _ENVIRON_READERS):
            self.guard_environ(depth)
        elif isinstance(value, functools.partial):
            self.visit(value.func, f"{label}.func", depth + 1)
            self.visit(value.args, f"{label}.args", depth + 1)
            self.visit(value.keywords, f"{label}.keywords", depth + 1)
        elif isinstance(value, (bytearray, array.array)) or _is_ndarray(value):
            self.guard_contents(value, label)
        elif isinstance(value, type):
            self.visit_class(value, depth)
        else:
            self.visit_object(value, label, depth)

    def visit_module(self, module: nn.Module, depth: int) -> None:
        label = self._label(module, f"<{type(module).__name__}>")
        # `training` is a graph input or a flag guard; the tree and hook dicts are
        # version-guarded by guard_builder; children are walked below.
        # The tree dicts by identity (compared, not walked: guard_builder and the
        # container guard below compare their contents): Sequential.__delitem__
        # rebinds `_modules` to a new dict, leaving the guarded one unchanged.
        self.guard_namespace(module.__dict__, label, depth, skip=_MODULE_INTERNALS - frozenset(_TREE_DICTS),
                             owner=module, pinned=_TREE_DICTS, attributes="whole")
        if id(module) not in self.visited:
            # A container the forward iterated or indexed without calling it
            # (ModuleList, ModuleDict, Sequential): an appended, replaced or removed
            # child changes what the forward runs.
            self.guard_namespace(module._modules, f"{label}._modules", depth,
                                 names=list(module._modules), exact=True)
        self.visit_class(type(module), depth)
        for name, child in module._modules.items():
            if child is not None:
                self.visit(child, f"{label}.{name}", depth + 1)

    def visit_object(self, obj: Any, label: str, depth: int) -> None:
        namespace = getattr(obj, "__dict__", None)
        if type(namespace) is dict:
            weakly = type(obj).__weakrefoffset__ != 0
            # an object of a library's class (a logging.Logger) is read by the library,
            # which is trusted for its own state: by the names user code reads only
            self.guard_namespace(namespace, label, depth, owner=obj if weakly else None,
                                 attributes="" if _is_library_class(type(obj)) else "whole")
        slots = _slot_names(type(obj))
        names = tuple(sorted(n for n in slots if n in self.names))
        if names:
            # Attributes in slots: no dict, so no version; read where they live and
            # compared on every hit (VG_SLOTS, in C).
            stored = tuple(slots[n] for n in names)
            values = tuple(getattr(obj, n, MISSING) for n in stored)
            self.out.add((VG_SLOTS, obj, stored, values, MISSING),
                         f"{label}: slots {', '.join(names)} of a {type(obj).__name__} "
                         f"(compared on each call)")
            for name, value in zip(names, values):
                self.visit(value, f"{label}.{name}", depth + 1)
        self.visit_class(type(obj), depth)

    def guard_environ(self, depth: int) -> None:
        """os.environ, read by `os.environ[...]`, `.get` or `os.getenv`: its whole
        content (a dict of bytes whose version moves on every change)."""
        data = getattr(os.environ, "_data", None)
        if type(data) is dict:
            self.guard_namespace(data, "os.environ", depth, names=list(data), exact=True)
        else:
            self.guard_contents(os.environ, "os.environ")

    def guard_contents(self, obj: Any, label: str) -> None:
        """A mutable object no dict version covers (a NumPy array, a bytearray):
        its bytes, compared on every hit; one too large to compare makes the
        capture run eagerly."""
        why = _buffer_fallback(obj)
        if why is not None:
            self.out.unguardable.append(
                f"{label} (a {type(obj).__name__} the guards cannot compare: {why})")
            return
        self.out.add((VG_BYTES, obj),
                     f"{label}: contents of a {type(obj).__name__} (compared on each call)")

    def visit_class(self, cls: type, depth: int) -> None:
        for klass in cls.__mro__:
            if klass is object or klass.__module__ == "builtins":
                continue
            namespace = _real_dict(klass)
            if namespace is None or id(namespace) in self._keys:
                continue
            present = set(k for k in self.names if k in namespace)
            if klass.__module__.startswith("torch."):
                # torch's own classes: only plain values (class-level constants such as
                # `_version`), not the methods (monkeypatching torch is out of scope)
                present = set(k for k in present if isinstance(namespace[k], _ATOMS))
                self.guard_namespace(namespace, f"class {klass.__qualname__}", depth,
                                     names=present)
            else:
                self.guard_namespace(namespace, f"class {klass.__qualname__}", depth,
                                     names=present, attributes="class")

    def visit_function(self, fn: types.FunctionType, label: str, depth: int) -> None:
        if is_library_file(fn.__code__.co_filename):
            return
        self.out.add((VG_FUNCTION, fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__),
                     f"{label}: code and defaults of {fn.__qualname__}")
        for i, default in enumerate(fn.__defaults__ or ()):
            self.visit(default, f"{label}.__defaults__[{i}]", depth + 1)
        self.guard_cells(fn, label, depth)

    def guard_cells(self, fn: Any, label: str, depth: int) -> None:
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                content = cell.cell_contents
            except ValueError:  # empty cell
                continue
            if isinstance(content, nn.Module):
                continue  # modules: walked through the tree; their cells stay bound
            self.out.add((VG_CELL, cell, content), f"{label}: closure cell {name!r}")
            self.visit(content, f"{label}.<cell {name}>", depth + 1)


def build_state_value_guards(
    recorder: CodeRecorder,
    root: Optional[nn.Module],
    modules: Iterable[nn.Module],
    fn: Optional[Callable[..., Any]],
    arguments: Iterable[tuple[str, Any]],
    labels: dict[int, str],
    guard_tensor_metadata: bool,
    attr_tensors: Iterable[torch.Tensor] = (),
    metadata_tensors: Iterable[torch.Tensor] = (),
) -> StateGuardSet:
    """The value guards of one capture; `labels`: id(module) -> path for messages."""
    modules = list(modules)
    walk = _StateWalk(recorder.names(), labels, modules,
                      every_key=recorder.reads_keys_by_value())
    if root is not None:
        walk.visit(root, "self", 0)
    for module in modules:
        walk.visit(module, walk._label(module, type(module).__name__), 0)
    if fn is not None and getattr(fn, "__closure__", None):
        walk.guard_cells(fn, getattr(fn, "__qualname__", "forward"), 0)
    for user_fn in recorder.user_functions():
        walk.guard_cells(user_fn, user_fn.__qualname__, 0)
    for scope, names in list(recorder.globals.values()):
        module_name = scope.get("__name__", "?")
        walk.guard_namespace(scope, f"globals of {module_name}", 0, names=set(names))
    for name, value in arguments:
        walk.visit(value, f"argument {name}", 0)
    if guard_tensor_metadata:
        # Those the graph uses as attributes, and those Python read the metadata of
        # without the graph using them, when they outlive the call (module state:
        # parameters, buffers, tensors found in the walk above).
        read = list(metadata_tensors)
        if read:
            state = dict(walk.out.state_tensors)
            for module in modules:
                state.update((id(t), t) for t in module.parameters(recurse=False))
                state.update((id(t), t) for t in module.buffers(recurse=False))
            if root is not None:
                state.update((id(t), t) for t in root.parameters())
                state.update((id(t), t) for t in root.buffers())
            read = [t for t in read if id(t) in state]
        tensors = list({id(t): t for t in [*attr_tensors, *read]}.values())
        if tensors:
            with torch._C.DisableTorchFunction():
                metas = tuple((t.dtype, t.device, tuple(t.shape)) for t in tensors)
            walk.out.add((VG_TENSORS, APPLY_EPOCH, tuple(weakref.ref(t) for t in tensors), metas),
                         f"dtype/device/shape of {len(tensors)} parameters, buffers and "
                         "constants (re-read after Module.to()/half()/cuda())")
    return walk.out


def global_state_guard() -> tuple[Any, tuple[Any, ...]]:
    """torch's GlobalStateGuard made now, and its value-guard spec."""
    guard = torch._C._dynamo.guards.GlobalStateGuard()
    return guard, (VG_CALL, guard.check)


def identity_keyed(value: Any, depth: int = 0) -> Iterable[Any]:
    """The objects inside an argument that the per-call key names by identity (see
    guards/call_key.c): their state is guarded; containers keyed by value are not
    (the next call passes other containers with the same contents)."""
    if isinstance(value, (_ATOMS, torch.Tensor, nn.Module)):
        return
    if depth < MAX_DEPTH and keyed_objects.is_keyed(value):
        # keyed by type and __dict__ (TAG_STRUCT: the dict one level down)
        for item in list(vars(value).values()):
            yield from identity_keyed(item, depth + 2)
        return
    if depth >= MAX_DEPTH:
        # guards/call_key.c keys containers by value above its depth bound (the same
        # MAX_DEPTH) and by identity from there: their contents are state to guard
        yield value
        return
    if type(value) in (tuple, list) or (isinstance(value, tuple) and not hasattr(value, "__dict__")):
        for item in value:
            yield from identity_keyed(item, depth + 1)
    elif type(value) is dict:
        for item in value.values():
            yield from identity_keyed(item, depth + 1)
    elif type(value).__module__ != "numpy":
        yield value


Snapshot = list[tuple[Any, Any, str, str]]   # (container, contents, label, argument)


def argument_snapshot(values: Iterable[tuple[str, Any]]) -> Snapshot:
    """What a forward could mutate in its non-tensor arguments: containers' items and
    objects' __dict__ contents, recursively (compared by `mutated_arguments`)."""
    seen: set[int] = set()
    out: Snapshot = []
    argument = ""

    def walk(value: Any, label: str, depth: int) -> None:
        if (depth > MAX_DEPTH or isinstance(value, (_ATOMS, torch.Tensor, nn.Module))
                or isinstance(value, _OPAQUE) or id(value) in seen
                # a KV cache: what the forward writes into it is replayed
                # (capture/passed_objects.py), or the capture refused
                or keyed_objects.is_keyed(value)
                or isinstance(value, (types.FunctionType, types.ModuleType, type))):
            return
        seen.add(id(value))
        items: Iterable[tuple[Any, Any]]
        if isinstance(value, list):
            out.append((value, tuple(value), f"{label} (list)", argument))
            items = enumerate(list(value))
        elif isinstance(value, dict):
            out.append((value, tuple(value.items()), f"{label} (dict)", argument))
            items = list(value.items())
        elif isinstance(value, tuple):
            items = enumerate(value)
        elif isinstance(value, set):
            out.append((value, frozenset(value), f"{label} (set)", argument))
            items = ()
        else:
            namespace = getattr(value, "__dict__", None)
            if type(namespace) is not dict:
                return
            out.append((namespace, tuple(namespace.items()),
                        f"{label} (attributes of a {type(value).__name__})", argument))
            items = list(namespace.items())
        for key, item in items:
            walk(item, f"{label}[{key!r}]", depth + 1)

    for name, value in values:
        argument = name
        walk(value, name, 0)
    return out


def forward_namespace_values(fn: Any, tensors: bool = False) -> list[tuple[str, Any]]:
    """What the forward's own code can reach before it runs: its closure cells and
    the globals its code (nested code included) names.  `argument_snapshot` of these,
    compared after the capture, finds in-place edits of state (a global list
    appended to) that no graph replays.  With `tensors`, the tensors among them
    are kept too."""
    code = getattr(fn, "__code__", None)
    if code is None or _is_library_function(fn):
        return []
    values: list[tuple[str, Any]] = []
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            values.append((f"closure cell {name!r}", cell.cell_contents))
        except ValueError:
            continue
    scope = getattr(fn, "__globals__", None) or {}
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    for name in sorted(names):
        value = scope.get(name, MISSING)
        if value is not MISSING:
            values.append((f"global {name!r}", value))
    # Objects of library classes (a `logging.Logger` caching its levels) keep their
    # own bookkeeping; plain containers and the user's objects are the state.
    return [(label, value) for label, value in values
            if type(value) in _CONTAINERS or not _is_library_type(type(value))
            or (tensors and isinstance(value, torch.Tensor))]


def _is_library_type(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    return module is not None and _is_library_module(module)


_CONTAINERS = (list, dict, set)


def python_rng_state() -> tuple:
    """Where Python's global `random` generator and NumPy's legacy global one stand:
    a capture during which it moved drew numbers a graph would bake in as constants
    (torch's own generators are graph ops and draw anew on every replay)."""
    state: list[Any] = [random.getstate()]
    np_random = sys.modules.get("numpy.random")
    if np_random is None and "numpy" in sys.modules:
        # torch imports numpy but not numpy.random, which torch code then imports
        # lazily, in the middle of a capture (torch.cond's first use): imported here
        # first (once, about 6 ms), its state is known before the forward runs.
        try:
            import numpy.random as np_random
        except ImportError:
            np_random = None
    get_state = getattr(np_random, "get_state", None)
    if get_state is not None:
        name, key, pos, has_gauss, cached = get_state()
        state.append((name, key.tobytes(), pos, has_gauss, cached))
    return tuple(state)


def mutated_arguments(snapshot: Snapshot) -> Optional[tuple[str, str]]:
    """The first container or object of `argument_snapshot` that changed, named, and
    the argument it was reached from."""
    for container, before, label, argument in snapshot:
        if isinstance(container, set):
            now: Any = frozenset(container)
            changed = now != before
        elif isinstance(container, dict):
            now = tuple(container.items())
            changed = len(now) != len(before) or any(
                a[0] is not b[0] and a[0] != b[0] or a[1] is not b[1] for a, b in zip(now, before))
        else:
            now = tuple(container)
            changed = len(now) != len(before) or any(a is not b for a, b in zip(now, before))
        if changed:
            return label, argument
    return None
