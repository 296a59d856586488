"""Python values that stand for graph values while a capture runs.

`TrainingFlag` is what `module.training` reads as on the tracing thread for the length
of one trace (trace_patches' descriptor on `nn.Module` asks the tracer; the module's
`__dict__` keeps its real bool, so other threads never see a flag). Used as a *value* (it reaches a torch function or `ifexpr`) it becomes a
graph input; used for *branching* (`bool()`, comparisons, arithmetic, `int()`) it
behaves as the bool it holds and tells the tracer, which then specialises the graph on
that module's flag.

`TrackedFloat` / `TrackedInt` are Python numbers computed from a training flag
(`ifexpr(self.training, p, 0.0)`) or returned by an opaque op. They carry the graph node
that computes them, so that when they reach a torch function later (`dropout_p=`) the
node is the argument. Any other use specialises, exactly like a flag used for branching.

Known limit: C code that reads the number straight out of the object (`math.sqrt(p)`,
`range(flag)`, list indexing by the flag) sees the value without calling a dunder, so
no branch is recorded for it. Such code gets the traced mode's value baked in.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional

from nnscaler_eval.tracing.trace_state import current_tracer


def _recording_tracer(owner: Any) -> Optional[Any]:
    """`owner` if it is this thread's tracer and is recording; else None.

    A flag can escape its trace's recording (stored by user code where another thread,
    or opaque code run with recording suspended, reads it): such uses must behave as
    plain bools and record nothing.
    """
    tracer = current_tracer()
    if tracer is not None and tracer is owner and tracer.recording:
        return tracer
    return None


class TrainingFlag(int):
    """`module.training` during a trace: an int (0/1) that knows its module.

    An int subclass because `bool` cannot be subclassed; `repr` and `str` still say
    `True` / `False`.
    """

    # int subclasses cannot have non-empty __slots__, so these live in __dict__.
    module: Any
    value: bool
    tracer: Any

    def __new__(cls, value: bool, module: Any, tracer: Any) -> "TrainingFlag":
        flag = super().__new__(cls, 1 if value else 0)
        flag.module = module
        flag.value = bool(value)
        flag.tracer = tracer
        return flag

    def specialise(self) -> bool:
        """The plain bool, after telling the tracer that Python branched on it."""
        tracer = _recording_tracer(self.tracer)
        if tracer is not None:
            tracer.note_branch(self.module, self.value)
        return self.value

    def __bool__(self) -> bool:
        return self.specialise()

    def __repr__(self) -> str:
        return repr(self.specialise())

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(self.specialise(), spec)

    def __hash__(self) -> int:
        return hash(self.specialise())

    def __reduce__(self) -> Any:
        # Pickling or copying a flag yields the plain bool: a flag must never outlive
        # its trace.
        return (bool, (self.specialise(),))


class _TrackedNumber:
    """Mixin state for numbers computed in the graph (see module docstring)."""

    node: Any
    deps: tuple[Any, ...]  # modules whose training flags the value depends on
    tracer: Any
    plain: Any  # the value as a plain float / int

    def specialise(self) -> Any:
        tracer = _recording_tracer(self.tracer)
        if tracer is not None:
            tracer.specialise_number(self)
        return self.plain


class TrackedFloat(_TrackedNumber, float):
    def __new__(cls, value: float, node: Any, deps: tuple[Any, ...], tracer: Any) -> "TrackedFloat":
        number = float.__new__(cls, value)
        number.plain = float(value)
        number.node, number.deps, number.tracer = node, deps, tracer
        return number


class TrackedInt(_TrackedNumber, int):
    def __new__(cls, value: int, node: Any, deps: tuple[Any, ...], tracer: Any) -> "TrackedInt":
        number = int.__new__(cls, value)
        # A bool stays a bool when specialised (ifexpr(self.training, True, False)).
        number.plain = value if isinstance(value, bool) else int(value)
        number.node, number.deps, number.tracer = node, deps, tracer
        return number


def plain_value(value: Any) -> Any:
    """The plain Python value behind a flag or tracked number, recording a branch."""
    if isinstance(value, TrainingFlag):
        return value.specialise()
    if isinstance(value, _TrackedNumber):
        return value.specialise()
    return value


# Presentation goes through the plain value's own type, so a tracked bool prints `True`.
_BY_PLAIN_TYPE: dict[str, Callable[..., Any]] = {
    "__repr__": repr,
    "__str__": str,
    "__format__": format,
    "__hash__": hash,
}


def quiet_plain(value: Any) -> Any:
    """Flags and tracked numbers as plain values, recording nothing; containers too
    (rebuilt only when something inside changed)."""
    if isinstance(value, TrainingFlag):
        return value.value
    if isinstance(value, _TrackedNumber):
        return value.plain
    if isinstance(value, (tuple, list)):
        items = [quiet_plain(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        plain = {k: quiet_plain(v) for k, v in value.items()}
        if all(plain[k] is v for k, v in value.items()):
            return value
        return plain
    return value


def holds_tracked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Is a flag or tracked number among the arguments (or one container deep)?"""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (TrainingFlag, _TrackedNumber)):
            return True
        if isinstance(value, (tuple, list)) and any(
            isinstance(v, (TrainingFlag, _TrackedNumber)) for v in value
        ):
            return True
    return False


def _specialising_method(base: type, name: str) -> Callable[..., Any]:
    base_method = _BY_PLAIN_TYPE.get(name) or getattr(base, name)
    recorded = _RECORDED.get(name)

    def method(self: Any, *args: Any) -> Any:
        if recorded is not None and isinstance(self, _TrackedNumber):
            # A tracer that keeps Python values as graph values (export for
            # nnScaler, capture/python_values.py) records the operator instead; so
            # does any tracer for a number that came from tensor data (a count of a
            # data-dependent shape): `n > 0` stays a graph value an `if` can branch on.
            tracer = _recording_tracer(self.tracer)
            if tracer is not None and getattr(tracer, "python_values", None) is not None:
                function, reflected = recorded
                operands = (args[0], self) if reflected else (self, *args)
                return tracer.python_values.operator(function, operands)
            if tracer is not None and getattr(self, "data_dependent", False) and all(
                    isinstance(a, (int, float)) for a in args):
                function, reflected = recorded
                operands = (args[0], self) if reflected else (self, *args)
                return tracer.number_operator(function, operands)
        return base_method(self.specialise(), *[plain_value(a) for a in args])

    method.__name__ = name
    return method


# Python's operators on tracked numbers that a value-keeping tracer records:
# dunder -> (the operator, whether the number is the right operand).
_RECORDED: dict[str, tuple[Callable[..., Any], bool]] = {
    **{f"__{op}__": (getattr(operator, op), False)
       for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "lt", "le",
                  "gt", "ge", "eq", "ne", "and_", "or_", "xor", "lshift", "rshift")
       if not op.endswith("_")},
    **{f"__r{op}__": (getattr(operator, op), True)
       for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "lshift",
                  "rshift")},
    "__and__": (operator.and_, False), "__rand__": (operator.and_, True),
    "__or__": (operator.or_, False), "__ror__": (operator.or_, True),
    "__xor__": (operator.xor, False), "__rxor__": (operator.xor, True),
    "__neg__": (operator.neg, False), "__pos__": (operator.pos, False),
    "__abs__": (operator.abs, False), "__invert__": (operator.invert, False),
}


# Every dunder through which Python code can *look at* a number. Each one specialises
# the graph on the flags the number depends on, then answers with the plain value.
_NUMBER_DUNDERS = (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__rmod__",
    "__divmod__",
    "__rdivmod__",
    "__pow__",
    "__rpow__",
    "__neg__",
    "__pos__",
    "__abs__",
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__int__",
    "__float__",
    "__round__",
    "__trunc__",
    "__floor__",
    "__ceil__",
    "__bool__",
    "__hash__",
    "__repr__",
    "__str__",
    "__format__",
    "__complex__",
)
_INT_ONLY_DUNDERS = (
    "__and__",
    "__rand__",
    "__or__",
    "__ror__",
    "__xor__",
    "__rxor__",
    "__lshift__",
    "__rlshift__",
    "__rshift__",
    "__rrshift__",
    "__invert__",
    "__index__",
)

for _name in _NUMBER_DUNDERS + _INT_ONLY_DUNDERS:
    if hasattr(int, _name) and _name not in (
        "__hash__",
        "__repr__",
        "__str__",
        "__format__",
        "__bool__",
    ):
        setattr(TrainingFlag, _name, _specialising_method(int, _name))
    if hasattr(int, _name):
        setattr(TrackedInt, _name, _specialising_method(int, _name))
    if hasattr(float, _name) and _name not in _INT_ONLY_DUNDERS:
        setattr(TrackedFloat, _name, _specialising_method(float, _name))
del _name


def _tracked_reduce(self: Any) -> Any:
    plain = self.specialise()
    return (type(plain), (plain,))


TrackedFloat.__reduce__ = _tracked_reduce  # type: ignore[method-assign,assignment]
TrackedInt.__reduce__ = _tracked_reduce  # type: ignore[method-assign,assignment]
