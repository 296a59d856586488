"""Python values computed from a forward's inputs, kept as graph values (export for
nnScaler).

nnScaler's generated module is called later with other inputs, and has no guards: a
number an input decided, baked in as a constant, is a wrong answer then (`return out,
y + 10` exported with y=1.0 returns 11.0 for every y).  nnScaler's own tracer wraps
every value in a proxy and records Python's operators on it.  A tracer given a
`PythonValues` (export_for_nnscaler's) does the same for the values that flow from
the inputs:

- int, float and bool arguments, at the top level and inside tuples, lists and dicts,
  are placeholders (`inputs`), handed to the forward as `TrackedInt` / `TrackedFloat`;
- Python's arithmetic, comparisons and bit operators on them record `operator` nodes
  and return tracked numbers (`operator`, asked by tracked_values' dunders);
- shape queries (`x.size()`, `x.shape`, `x.size(d)`) record a node and return a
  `TrackedTuple` or a tracked int; indexing and unpacking a TrackedTuple record
  `getitem` nodes (`query`);
- `Tensor.item()` records `item` (`data_value`).  `float(t)`, `int(t)` and a tensor
  used as an index cannot: Python turns what `__float__` returns into a plain float,
  so such a value would be baked in; the export refuses it (tracer.py);
- a dict argument is a `TrackedDict`: `d.get(k, default)` records `dict.get`;
- an object of a plain Python class passed in has, for the length of the trace, a
  subclass of its class whose attribute reads by user code record `getattr`
  (`restore()` puts each object's class back, however the trace ends).

A use that needs the *plain* value (`if y > 0:`, `range(n)`, a dict key, a C function
reading the int) takes the value of this run, as nnScaler's concrete trace does.
Compiled captures (guarded, keyed by these values) never use this: they are
specialised on them, soundly.
"""

from __future__ import annotations

import builtins
import math
import operator
import sys
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from nnscaler_eval import microsoft_nnscaler
from nnscaler_eval.tracing.locations import is_library_file
from nnscaler_eval.tracing.tracked_values import (
    TrainingFlag,
    TrackedFloat,
    TrackedInt,
    _TrackedNumber,
    quiet_plain,
)


class _RecordedItems:
    """Indexing, slicing and unpacking by user code record `getitem` nodes of `node`
    (ours and torch's read the plain items)."""

    node: Any
    tracking: "PythonValues"   # not `values`: a dict has a method of that name
    _base: type

    def __getitem__(self, index: Any) -> Any:
        plain = self._base.__getitem__(self, index)
        if not self.tracking.recording or is_library_file(sys._getframe(1).f_code.co_filename):
            return plain
        return self._recorded(index, plain)

    def __iter__(self) -> Any:
        if not self.tracking.recording or is_library_file(sys._getframe(1).f_code.co_filename):
            return self._base.__iter__(self)
        return iter([self._recorded(i, self._base.__getitem__(self, i))
                     for i in range(len(self))])

    def _recorded(self, index: Any, plain: Any) -> Any:
        node = self.tracking.node(operator.getitem, (self.node, index))
        if isinstance(index, slice):
            return type(self)(plain, node, self.tracking)
        return self.tracking.number(plain, node, ())


class TrackedTuple(_RecordedItems, tuple):
    """A tuple a node computes: a shape the forward read (`x.size()`; torch.Size cannot
    be subclassed, and torch's functions take a tuple as a size), or what a registered
    op returned."""

    _base = tuple

    def __new__(cls, items: Any, node: Any, values: "PythonValues") -> "TrackedTuple":
        tracked = super().__new__(cls, tuple(items))
        tracked.node, tracked.tracking = node, values
        return tracked

    def numel(self) -> Any:
        return torch.Size(self).numel()

    def __reduce__(self) -> Any:
        return (tuple, (tuple(self),))


class TrackedList(_RecordedItems, list):
    """A list a node computes (what a registered op returned): one value of the graph,
    as nnScaler's tracer keeps it."""

    _base = list

    def __init__(self, items: Any, node: Any, values: "PythonValues") -> None:
        super().__init__(items)
        self.node, self.tracking = node, values

    def __reduce__(self) -> Any:
        return (list, (list(self),))


TRACKED_SEQUENCES = (TrackedTuple, TrackedList)


class TrackedDict(dict):
    """A dict argument: `get` records `dict.get` (a key it lacks today may be there in
    a later call of the generated module)."""

    node: Any
    tracking: "PythonValues"

    def get(self, key: Any, default: Any = None) -> Any:   # type: ignore[override]
        found = dict.get(self, key, default)
        if not self.tracking.recording:
            return found
        tracer = self.tracking.tracer
        node = tracer.create_node("call_method", "get", tracer.graph_arg((self.node, key, default)),
                                  {})
        return self.tracking.rebound(found, node)


class PythonValues:
    """The value-keeping half of one tracer (see the module docstring)."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        # objects passed in whose class is swapped for a recording subclass: id ->
        # (the object, its class, its node)
        self.objects: dict[int, tuple[Any, type, fx.Node]] = {}
        # `math`'s functions, each replaced by one that records a call on tracked
        # numbers (Python would take a plain float from them: `math.exp(y)` baked in),
        # put back by restore(): name -> the original
        self.math_functions: dict[str, Any] = {}
        # nnScaler's op context (`with nnscaler.constant_folding():` sets it while the
        # forward runs); each node keeps what it was when the node was made
        self.op_context = microsoft_nnscaler.module("graph.tracer.metadata")._GLOBAL_OP_CONTEXT
        for name in _MATH_FUNCTIONS:
            original = getattr(math, name, None)
            if original is not None:
                self.math_functions[name] = original
                setattr(math, name, self._math_recorder(original))

    def node_context(self) -> Optional[bool]:
        """The `constant_folding` of nnScaler's op context now (a node's
        `nnscaler_constant_folding`; parallelize's metadata run puts it back)."""
        return self.op_context.constant_folding

    def _math_recorder(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any) -> Any:
            if self.recording and any(isinstance(a, _TrackedNumber) and a.tracer is self.tracer
                                      for a in args):
                return self.operator(original, args)
            return original(*args)

        recorded.__name__ = recorded.__qualname__ = original.__name__
        recorded.__wrapped__ = original   # type: ignore[attr-defined]
        return recorded

    @property
    def recording(self) -> bool:
        return bool(self.tracer.recording)

    def node(self, function: Callable[..., Any], args: tuple[Any, ...]) -> fx.Node:
        """A call_function node of `function` on `args` (values or nodes)."""
        return self.tracer.create_node("call_function", function,
                                       self.tracer.graph_arg(args), {})

    def number(self, value: Any, node: fx.Node, deps: tuple[Any, ...],
               data_dependent: bool = False) -> Any:
        """`value` as a tracked number standing for `node` (other values: as they are)."""
        if isinstance(value, bool) or isinstance(value, int):
            number: Any = TrackedInt(value, node, deps, self.tracer)
        elif isinstance(value, float):
            number = TrackedFloat(value, node, deps, self.tracer)
        else:
            return value
        if data_dependent:
            number.data_dependent = True
        return number

    def rebound(self, value: Any, node: fx.Node) -> Any:
        """What a recorded call returned, standing for `node`: a tensor as a fresh alias
        (the original keeps its own node), a number tracked."""
        if isinstance(value, torch.Tensor):
            with self.tracer.suspended():
                alias = value.view_as(value)
            self.tracer.nodes.map(alias, node, dynamic=self.tracer.nodes.dynamic_among(value))
            return alias
        return self.number(value, node, ())

    # -- what the tracer and tracked numbers ask ------------------------------------

    def operator(self, function: Callable[..., Any], operands: tuple[Any, ...]) -> Any:
        """Python's `function` (an operator) on tracked numbers: recorded."""
        plain = function(*quiet_plain(operands))
        deps = tuple(dict.fromkeys(m for o in operands if isinstance(o, _TrackedNumber)
                                   for m in o.deps))
        data_dependent = any(getattr(o, "data_dependent", False) for o in operands)
        node = self.node(function, operands)
        return self.number(plain, node, deps, data_dependent)

    def inputs(self, slot: Any, slot_name: str, index: int,
               placeholder: Callable[[str, Any, int, tuple], fx.Node]) -> Any:
        """The argument `slot` with its numbers tracked (placeholders through
        `placeholder(name, value, index, keys)`) and its dicts TrackedDicts; the
        slot itself when nothing in it is such a value."""
        def wrap(value: Any, keys: tuple) -> Any:
            if isinstance(value, TrainingFlag) or isinstance(value, _TrackedNumber):
                return value
            if isinstance(value, (bool, int, float)) and not isinstance(value, torch.Tensor):
                name = slot_name + "".join(_suffix(k) for k in keys)
                return self.number(value, placeholder(name, value, index, keys), ())
            if type(value) is dict:
                items = {k: wrap(v, keys + (pytree.MappingKey(k),)) for k, v in value.items()}
                tracked = TrackedDict(items)
                name = slot_name + "".join(_suffix(k) for k in keys)
                tracked.node = placeholder(name, None, index, keys)
                tracked.tracking = self
                return tracked
            if type(value) in (list, tuple):
                items = [wrap(v, keys + (pytree.SequenceKey(i),)) for i, v in enumerate(value)]
                if all(a is b for a, b in zip(items, value)):
                    return value
                return items if type(value) is list else tuple(items)
            if _plain_object(value) and id(value) not in self.objects:
                name = slot_name + "".join(_suffix(k) for k in keys)
                node = placeholder(name, None, index, keys)
                self.objects[id(value)] = (value, type(value), node)
                value.__class__ = _recording_class(type(value))
            return value
        return wrap(slot, ())

    def attribute(self, obj: Any, name: str, value: Any) -> Any:
        """`obj.name` read by user code from an object passed in: recorded."""
        node = self.tracer.create_node("call_function", builtins.getattr,
                                       (self.objects[id(obj)][2], name), {})
        return self.rebound(value, node)

    def restore(self) -> None:
        """Every swapped object its own class back, `math` as it was (idempotent)."""
        for name, original in self.math_functions.items():
            setattr(math, name, original)
        self.math_functions.clear()
        for key, (obj, cls, _) in list(self.objects.items()):
            if type(obj) is not cls:
                obj.__class__ = cls
            del self.objects[key]

    def query(self, func: Any, kind: str, target: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any], result: Any) -> Any:
        """A shape query's result, recorded: `x.size()` / `x.shape` as a TrackedTuple,
        `x.size(d)` as a tracked int.  Other metadata stays a constant (None)."""
        if kind == "getattr" and target == "shape":
            node = self.tracer.create_node("call_function", builtins.getattr,
                                           (self.tracer.graph_arg(args[0]), "shape"), {})
        elif kind == "method" and target == "size":
            node = self.tracer.create_node("call_method", "size",
                                           self.tracer.graph_arg(args),
                                           self.tracer.graph_arg(kwargs))
        else:
            return None
        if isinstance(result, torch.Size):
            return TrackedTuple(result, node, self)
        return self.number(result, node, ())

    def sequence(self, value: Any, node: fx.Node) -> Any:
        """A tuple or list a registered op returned, standing for its node."""
        return (TrackedTuple if isinstance(value, tuple) else TrackedList)(value, node, self)

    def leaf(self, target: Any, body: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """nnScaler's runtime function `target` (its code `body`) as one node; what it
        returns stands for the node (runtime.nnscaler_leaf)."""
        node = self.tracer.create_node("call_function", target, self.tracer.graph_arg(args),
                                       self.tracer.graph_arg(kwargs))
        result = body(*quiet_plain(args), **quiet_plain(kwargs))
        if type(result) in (tuple, list):
            return self.sequence(result, node)
        return self.rebound(result, node)

    def data_value(self, args: tuple[Any, ...], result: Any) -> Any:
        """`t.item()`: an `item` node, and its value tracked."""
        node = self.tracer.create_node("call_method", "item",
                                       (self.tracer.graph_arg(args[0]),), {})
        return self.number(result, node, (), data_dependent=True)


# `math` functions of numbers that nnScaler's tracer records as nodes too.
_MATH_FUNCTIONS = (
    "exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "pow", "sin", "cos", "tan",
    "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh", "erf", "erfc", "fabs",
    "floor", "ceil", "trunc", "hypot", "degrees", "radians", "copysign", "fmod",
)

# Tensor methods that hand a tensor's value to Python and that a value-keeping tracer
# records instead of refusing.
DATA_VALUES = frozenset({"item"})


def _plain_object(value: Any) -> bool:
    """An instance of a user's plain Python class (its state in its __dict__, no
    __slots__, not torch's, not a module, not a builtin type)."""
    cls = type(value)
    return (isinstance(getattr(value, "__dict__", None), dict)
            and cls.__module__ not in ("builtins",) and not cls.__module__.startswith("torch")
            and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
            and cls.__flags__ & _HEAPTYPE and "__slots__" not in vars(cls)
            and not is_library_file(getattr(sys.modules.get(cls.__module__), "__file__", None)
                                    or "<unknown>"))


_HEAPTYPE = 1 << 9
_recording_classes: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """A subclass of `cls` whose instances record the attributes user code reads (the
    object's class while a value-keeping trace runs)."""
    found = _recording_classes.get(cls)
    if found is not None:
        return found

    def __getattribute__(self: Any, name: str) -> Any:
        value = super(recording, self).__getattribute__(name)
        if name.startswith("__") or is_library_file(sys._getframe(1).f_code.co_filename):
            return value
        from nnscaler_eval.tracing.trace_state import current_tracer
        tracer = current_tracer()
        values = getattr(tracer, "python_values", None)
        if values is None or not tracer.recording or id(self) not in values.objects:
            return value
        return values.attribute(self, name, value)

    recording = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                            "__qualname__": cls.__qualname__,
                                            "__module__": cls.__module__})
    _recording_classes[cls] = recording
    return recording


def _suffix(key: Any) -> str:
    if isinstance(key, pytree.MappingKey):
        return f"_{key.key}"
    if isinstance(key, pytree.SequenceKey):
        return f"_{key.idx}"
    return f"_{key}"
