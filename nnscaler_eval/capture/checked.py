"""What a side of a converted `if` may do while it is traced on fake tensors.

The side that eager does not take must leave no trace of its run: its Python runs
once, at capture, on fake tensors, and the graph replays only its tensor ops.  So the
side runs as *checked* code (bytecode/instrument.py): the C evaluator hands every
frame of user code started meanwhile its checked flavour (`_C.checked_mode`), and
the checked code calls the screens below before anything that could change state
outside the side.  A screen returns what it looked at, or raises `BranchRefused`
with the reason; the side is then not converted, the frame falls back as before.

The rule: a side may create and change objects it made itself (`fresh`: lists,
dicts, sets, iterators it built), and change tensors through torch ops (the tracer
refuses in-place ops on tensors from outside the side, capture/cond.py).  It may call
torch (functions, tensor methods, modules: a module's forward is user code, checked
in turn), user code (checked in turn), and builtins that change nothing outside
their results.  It may read anything.  Anything else is refused: attribute and item
stores on objects from outside, in-place operators on them, consuming an iterator
from outside, `with` on a context manager that is not torch's or the user's, globals,
imports, printing, and calls of other code (the standard library's Python code,
C functions of other libraries).

`BranchRefused` is a BaseException, so a side's own `except Exception:` cannot
swallow a refusal; the refusal is also kept on the side's record, in case a bare
`except:` does.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import operator
import sys
import types
from typing import Any, Optional

import torch
import torch.nn as nn

from nnscaler_eval.tracing.locations import is_library_file, user_location
from nnscaler_eval.tracing.tracked_values import TrainingFlag, _TrackedNumber


_ORIGINAL_PRINT = builtins.print   # (tracing replaces builtins.print; both are refused)


class BranchRefused(BaseException):
    """Raised by a screen: the side does something a converted `if` cannot hold."""

    def __init__(self, reason: str, location: tuple[str, int]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.location = location


class SideRecord:
    """The objects one side's run made (they may be changed), and its refusal."""

    def __init__(self) -> None:
        self.fresh: dict[int, Any] = {}
        self.refusal: Optional[BranchRefused] = None

    def made(self, value: Any) -> Any:
        self.fresh[id(value)] = value
        return value

    def is_fresh(self, value: Any) -> bool:
        return self.fresh.get(id(value)) is value


_record: Optional[SideRecord] = None   # the side being traced (one capture at a time)


def current_record() -> Optional[SideRecord]:
    return _record


def set_record(record: Optional[SideRecord]) -> Optional[SideRecord]:
    global _record
    previous, _record = _record, record
    return previous


def refuse(reason: str) -> Any:
    error = BranchRefused(reason, user_location())
    if _record is not None and _record.refusal is None:
        _record.refusal = error
    raise error


# -- what may be called -------------------------------------------------------------

_PURE_BUILTINS = frozenset({
    abs, all, any, ascii, bin, callable, chr, divmod, format, getattr, hasattr, hash,
    hex, id, isinstance, issubclass, len, max, min, oct, ord, pow, repr, round, sorted,
    sum, iter,
})
_PURE_TYPES = frozenset({
    bool, int, float, complex, str, bytes, tuple, frozenset, list, dict, set, range,
    slice, zip, enumerate, reversed, map, filter, type(None), object,
})
# calls whose result is a new object the side may change
_MAKES_FRESH = frozenset({list, dict, set, zip, enumerate, reversed, map, filter, iter,
                          sorted, dict.copy, list.copy, set.copy})
_IMMUTABLE = (bool, int, float, complex, str, bytes, tuple, frozenset, type(None),
              torch.Size, torch.dtype, torch.device, torch.memory_format, torch.layout,
              TrainingFlag, _TrackedNumber, torch.SymInt, torch.SymFloat, torch.SymBool,
              range, slice, types.FunctionType, types.MethodType, type)
# methods of builtin containers that read only
_READING_METHODS = frozenset({
    "get", "items", "keys", "values", "copy", "count", "index", "__getitem__",
    "__contains__", "__len__", "__iter__", "issubset", "issuperset", "isdisjoint",
    "union", "intersection", "difference", "symmetric_difference", "__or__", "__and__",
})
_PURE_MODULES = ("math", "operator", "itertools", "functools", "_operator", "_functools",
                 "cmath")
_MUTATING_OPERATORS = frozenset({
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
    operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
    operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul,
    operator.iconcat, setattr, delattr,
})


def _name(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}.{name}" if module and module != "builtins" else str(name)


def _is_torch(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", "") or ""
    return module == "torch" or module.startswith(("torch.", "torch_"))


def _user_code(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and not is_library_file(code.co_filename)


def _screen(fn: Any, args: tuple) -> Optional[str]:
    """Why calling `fn(*args)` from a side is refused, or None when it may run."""
    if fn is builtins.print or fn is _ORIGINAL_PRINT:
        return "calls print() (a Python side effect the graph would not replay)"
    if isinstance(fn, nn.Module):
        return None    # through nn.Module.__call__: the tracer sees it, its forward is checked
    if isinstance(fn, types.MethodType):
        if isinstance(fn.__self__, torch.Tensor) or _is_torch(fn.__func__):
            return None
        if _user_code(fn.__func__):
            return None
        return f"calls {_name(fn.__func__)}, whose side effects cannot be checked"
    if isinstance(fn, types.FunctionType):
        if _user_code(fn) or _is_torch(fn) or (fn.__module__ or "").startswith(
                ("nnscaler_eval.", "typing")):
            return None    # ours: print() is patched to tell the tracer, which refuses
        return f"calls {_name(fn)}, whose side effects cannot be checked"
    if isinstance(fn, functools.partial):
        return _screen(fn.func, tuple(fn.args) + tuple(args))
    if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        owner = fn.__self__
        if isinstance(owner, torch.Tensor) or _is_torch(fn) or _is_torch(owner):
            return None
        if isinstance(owner, types.ModuleType):
            if fn in _PURE_BUILTINS or owner.__name__ in _PURE_MODULES:
                return None if fn not in _MUTATING_OPERATORS else \
                    f"calls {_name(fn)}, which changes its argument"
            return f"calls {_name(fn)}, whose side effects cannot be checked"
        return _method_call(owner, fn.__name__)
    if isinstance(fn, (types.MethodDescriptorType, types.WrapperDescriptorType,
                       types.ClassMethodDescriptorType)):
        owner = args[0] if args else None
        if _is_torch(fn.__objclass__) or isinstance(owner, torch.Tensor):
            return None
        return _method_call(owner, fn.__name__)
    if isinstance(fn, types.MethodWrapperType):
        return _method_call(fn.__self__, fn.__name__)
    if isinstance(fn, type):
        if fn in _PURE_TYPES or _is_torch(fn) or issubclass(fn, torch.Tensor):
            return None
        if _user_class(fn):
            return None    # made by _construct: fresh, then its __init__ runs checked
        return f"constructs {_name(fn)}, whose side effects cannot be checked"
    call = getattr(type(fn), "__call__", None)
    if isinstance(call, types.FunctionType):
        if _user_code(call) or _is_torch(call):
            return None
    if _is_torch(fn):
        return None
    return f"calls {_name(fn)}, whose side effects cannot be checked"


def _user_class(cls: type) -> bool:
    """A class of user code that type.__call__ makes (no metaclass call of its own)."""
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None)
    return (filename is not None and not is_library_file(filename)
            and type(cls).__call__ is type.__call__)


def _construct(cls: type, args: tuple, kwargs: dict) -> Any:
    """`cls(*args, **kwargs)` as type.__call__ does it, the new object marked fresh
    before its __init__ runs (so that the __init__ may set its attributes)."""
    new = cls.__new__
    obj = object.__new__(cls) if new is object.__new__ else new(cls, *args, **kwargs)
    if _record is not None:
        _record.made(obj)
    if isinstance(obj, cls):
        obj.__init__(*args, **kwargs)
    return obj


def _method_call(owner: Any, name: str) -> Optional[str]:
    if isinstance(owner, torch.Tensor) or _is_torch(type(owner)):
        return None
    if isinstance(owner, _IMMUTABLE) or name in _READING_METHODS:
        return None
    if _record is not None and _record.is_fresh(owner):
        return None
    return (f"calls {type(owner).__name__}.{name} on an object made outside the branch "
            "(a side effect the graph would not replay)")


def _checked_call(fn: Any, args: tuple, kwargs: dict) -> Any:
    reason = _screen(fn, args)
    if reason is not None:
        refuse(reason)
    if isinstance(fn, type) and not issubclass(fn, nn.Module) and _user_class(fn):
        return _construct(fn, args, kwargs)
    result = fn(*args, **kwargs)
    if _record is not None and (fn in _MAKES_FRESH or inspect.isgeneratorfunction(fn)
                                or (isinstance(fn, types.MethodType)
                                    and inspect.isgeneratorfunction(fn.__func__))):
        _record.made(result)
    return result


# -- the hooks the checked code calls (bytecode/instrument.py, Hooks) -------------------

def call(fn: Any, args: tuple, names: Optional[tuple] = None) -> Any:
    """The trampoline of CALL: `names` are the keyword names, last of `args`."""
    if names:
        split = len(args) - len(names)
        return _checked_call(fn, args[:split], dict(zip(names, args[split:])))
    return _checked_call(fn, args, {})


def call_kw(fn: Any, args_and_names: tuple) -> Any:
    """3.13+: CALL_KW, the keyword names the last item."""
    return call(fn, args_and_names[:-1], args_and_names[-1])


def call_ex(fn: Any, args: Any, kwargs: Optional[dict] = None) -> Any:
    """CALL_FUNCTION_EX: `f(*args, **kwargs)`."""
    return _checked_call(fn, tuple(args), dict(kwargs) if kwargs else {})


def attr_store(owner: Any) -> Any:
    # A module's attributes go through nn.Module.__setattr__, which the tracer sees
    # (state of the tree is refused there, a module made in the side is not).
    if isinstance(owner, nn.Module) or (_record is not None and _record.is_fresh(owner)):
        return owner
    return refuse(f"writes an attribute of a {type(owner).__name__} made outside the branch")


def item_store(container: Any) -> Any:
    if isinstance(container, torch.Tensor) or (_record is not None
                                               and _record.is_fresh(container)):
        return container
    return refuse(f"stores into a {type(container).__name__} made outside the branch")


def inplace(left: Any) -> Any:
    if isinstance(left, (torch.Tensor, *_IMMUTABLE)) or (_record is not None
                                                         and _record.is_fresh(left)):
        return left
    return refuse(f"changes a {type(left).__name__} made outside the branch in place")


def iterate(value: Any) -> Any:
    if not hasattr(type(value), "__next__") or isinstance(value, torch.Tensor):
        return value     # a container: iterating it makes a new iterator
    if _record is not None and _record.is_fresh(value):
        return value
    return refuse(f"consumes an iterator ({type(value).__name__}) made outside the branch")


def enter(manager: Any) -> Any:
    enter_method = getattr(type(manager), "__enter__", None)
    if _is_torch(type(manager)) or (isinstance(enter_method, types.FunctionType)
                                    and _user_code(enter_method)):
        return manager
    return refuse(f"enters a {type(manager).__name__} context")


def fresh(value: Any) -> Any:
    if _record is not None:
        _record.made(value)
    return value

