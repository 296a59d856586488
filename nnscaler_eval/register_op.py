"""`nnscaler.register_op`: a function that stays one opaque node in captured graphs.

    @nnscaler.register_op('?, ? -> ?')
    def get_dropout(training, dropout):
        return dropout if training else 0.0

    nnscaler.register_op('* k+, n k+ -> * n', name='my_linear')(fn)
    nnscaler.register_op(fn, '* k+, n k+ -> * n')

The annotation (grammar in `op_annotation`) is parsed and checked when the op is
registered; the registered op is a `functools.wraps` wrapper carrying
`__nnscaler_op__` (the OpAnnotation), `op_name` and `__wrapped__` (the function).

What a call does, in this order:

1. Inside an opaque call of the current tracer (see "recursion guard"): run the
   function for real.
2. A capture tracer is recording on this thread (`trace_state.current_tracer()`):
   return `tracer.call_opaque(op, args, kwargs)`, which runs the op for real with
   recording suspended and records one `call_function` node whose target is the op.
3. `torch.fx.symbolic_trace` (or any fx tracer): when an argument, at any depth of
   tuples, lists and dicts, is an `fx.Proxy`, record `create_proxy('call_function',
   op, args, kwargs)` on its tracer. While `symbolic_trace` runs, a call whose
   arguments are all constants (`get_dropout(self.training, self.dropout)`) is
   recorded too, on the tracer found on the stack, as `ifexpr` does: a registered
   op is a node in nnScaler's graphs whatever its arguments.
4. Otherwise: call the function.

Recursion guard. `call_opaque` is handed the *wrapper* (so the node's target carries
the annotation) and calls it back. Each thread keeps a stack of the tracers whose
`call_opaque` is running an op; while the innermost entry is the tracer that is
current now (or no tracer is current, when a tracer suspends recording by clearing
itself), the wrapper is being called back by that tracer, or by the op's own body, and
runs the function for real. So the op's body, and registered ops it calls, record
nothing: the op is one opaque node. A thread-local stack rather than calling
`__wrapped__` from the tracer keeps the tracer ignorant of register_op; comparing the
tracer rather than a plain flag lets a *different* tracer started inside the op's body
(a nested capture) still record the ops it meets.

The number of input annotations, N, is checked against the function's signature when
`inspect.signature` can read it. As in nnScaler, the annotations cover the first N
positional parameters and the parameters after them are the op's keyword options
(`'(h^ m^) kd+, kd+ n -> h^ m^ n'` on `f(x, w, h)`: `h` is passed as `h=...`):

- N may not exceed the number of positional parameters, unless the function takes
  `*args` (then any N is allowed);
- a positional-only parameter after the N-th that has no default is an error: it can
  only be passed positionally, so it needs an annotation (`?` if not a tensor);
- defaults, keyword-only parameters and `**kwargs` are otherwise free.

Registry: `registered_ops()` maps names to ops. Registering the same function again
under the same name with an equal annotation returns the existing op; a different
function under a taken name is an error naming both, except a redefinition of the same
function (same module and qualified name: a reloaded module, a re-run notebook cell),
which replaces the earlier registration. Lambdas are never taken as redefinitions.
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
import warnings
from typing import Any, Callable, Optional, Protocol, TypeVar, cast, overload

from nnscaler_eval import microsoft_nnscaler
from nnscaler_eval._C import call_holding as _call_holding
from nnscaler_eval.tracing.fx_tracing import active_fx_tracer
from nnscaler_eval.op_annotation import (
    ERROR_PREFIX,
    AnnotationError,
    Dim,
    DimGroup,
    OpAnnotation,
    TensorAnno,
    parse_annotation,
)
from nnscaler_eval.tracing.trace_state import current_tracer

__all__ = [
    "AnnotationError",
    "Dim",
    "DimGroup",
    "OpAnnotation",
    "RegisteredOp",
    "TensorAnno",
    "parse_annotation",
    "register_op",
    "registered_ops",
]

F = TypeVar("F", bound=Callable[..., Any])


class RegisteredOp(Protocol):
    """What `register_op` returns: the wrapper, callable like the function."""

    __nnscaler_op__: OpAnnotation
    op_name: str
    __wrapped__: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


_registry: dict[str, RegisteredOp] = {}
# Held through _call_holding: `with lock:` is not interrupt-safe on 3.13+
# (csrc/held_lock.h).
_registry_lock = threading.Lock()

# Per thread: the tracers whose call_opaque is running a registered op, innermost last.
_opaque_calls = threading.local()

_USAGE = ("use @register_op('a b -> a b'), register_op('a b -> a b', name='op')(fn) "
          "or register_op(fn, 'a b -> a b')")


@overload
def register_op(annotation: str, name: Optional[str] = None) -> Callable[[F], F]: ...


@overload
def register_op(fn: F, annotation: str, name: Optional[str] = None) -> F: ...


def register_op(*args: Any, **kwargs: Any) -> Any:
    """Register a function with an nnScaler dimension annotation.

    `register_op(annotation, name=None)` returns a decorator;
    `register_op(fn, annotation, name=None)` registers `fn` at once. The annotation is
    parsed here, so a bad one raises AnnotationError at the decorator's line.

    With Microsoft nnScaler installed (see "One registry with nnScaler" below) this is
    nnScaler's register_op, whole: its signature, annotations, checks, registry and
    return value (the function itself), with our `register_op(fn, annotation)` form
    as one addition; nnScaler's registry then hands each function to ours.
    """
    nnscaler_register = _nnscaler_register_op()
    if nnscaler_register is not None:
        if len(args) >= 2 and callable(args[0]) and not isinstance(args[0], str) \
                and isinstance(args[1], str):
            return nnscaler_register(*args[1:], **kwargs)(args[0])   # ours: (fn, annotation)
        return nnscaler_register(*args, **kwargs)
    allowed = ("annotation", "name")
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(f"register_op() got an unexpected keyword argument {unknown[0]!r}")
    fn: Optional[Callable[..., Any]] = None
    rest = list(args)
    if rest and not isinstance(rest[0], str) and callable(rest[0]):
        fn = rest.pop(0)  # register_op(fn, 'a -> a')
    if len(rest) > len(allowed):
        raise TypeError(f"register_op() takes an annotation and an optional name; {_USAGE}")
    params = dict(zip(allowed, rest))
    for key, value in kwargs.items():
        if key in params:
            raise TypeError(f"register_op() got multiple values for argument {key!r}")
        params[key] = value
    if "annotation" not in params:
        hint = (" (nnScaler's annotation functions, register_op(anno_fn), need nnScaler "
                "installed)" if fn is not None else "")
        raise TypeError(f"register_op() needs an annotation{hint}; {_USAGE}")
    text, name = params["annotation"], params.get("name")
    if not isinstance(text, str):
        if callable(text):
            raise TypeError("register_op(): annotation functions need Microsoft nnScaler "
                            f"installed; pass the annotation string. {_USAGE}")
        raise TypeError(f"register_op(): the annotation is a str like 'a b -> a b', "
                        f"not {type(text).__name__}")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TypeError(f"register_op(): name must be a non-empty str, not {name!r}")
    annotation = parse_annotation(text)
    if fn is not None:
        return _register(fn, annotation, name)

    def decorator(fn: F) -> F:
        return cast(F, _register(fn, annotation, name))

    return decorator


def registered_ops() -> dict[str, RegisteredOp]:
    """A copy of the registry: op name -> registered op."""
    return _call_holding(_registry_lock, dict, _registry)


def _register(fn: Callable[..., Any], annotation: Optional[OpAnnotation],
              name: Optional[str]) -> RegisteredOp:
    if not callable(fn):
        raise TypeError(f"register_op(): {fn!r} is not callable")
    if hasattr(fn, "__nnscaler_op__"):
        raise TypeError(f"register_op(): {_describe(fn)} is already a registered op "
                        f"({getattr(fn, 'op_name', '?')!r}); register the original function")
    if _is_module(fn):
        raise TypeError(f"register_op(): {_describe(fn)} is an nn.Module; register the "
                        "function it calls (an op owns no parameters)")
    op_name = name if name is not None else _default_name(fn)
    if annotation is not None:  # None: an nnScaler annotation function
        _check_arity(fn, annotation)
    return _call_holding(_registry_lock, _register_locked, fn, annotation, op_name)


def _register_locked(fn: Callable[..., Any], annotation: Optional[OpAnnotation],
                     op_name: str) -> RegisteredOp:
    existing = _registry.get(op_name)
    if existing is not None:
        old_fn = existing.__wrapped__
        if old_fn is fn:
            if existing.__nnscaler_op__ == annotation:
                return existing
            raise ValueError(
                f"{ERROR_PREFIX}: {_describe(fn)} is already registered as {op_name!r} "
                f"with annotation {_text(existing.__nnscaler_op__)!r}; it cannot be "
                f"registered again with {_text(annotation)!r}")
        if not _same_definition(old_fn, fn):
            raise ValueError(
                f"{ERROR_PREFIX}: the name {op_name!r} is taken by {_describe(old_fn)} "
                f"(annotation {_text(existing.__nnscaler_op__)!r}); cannot register "
                f"{_describe(fn)} under it. Pass name= to give one of them another name")
    op = _make_op(fn, annotation, op_name)
    _registry[op_name] = op
    return op


def _make_op(fn: Callable[..., Any], annotation: Optional[OpAnnotation],
             op_name: str) -> RegisteredOp:
    def registered_op(*args: Any, **kwargs: Any) -> Any:
        tracer = current_tracer()
        stack: Optional[list[Any]] = getattr(_opaque_calls, "stack", None)
        if stack and (tracer is None or stack[-1] is tracer):
            return fn(*args, **kwargs)  # called back by call_opaque, or from an op's body
        if tracer is not None:
            if stack is None:
                stack = _opaque_calls.stack = []
            stack.append(tracer)
            try:
                return tracer.call_opaque(registered_op, args, kwargs)
            finally:
                stack.pop()
        fx_tracer = active_fx_tracer(args, kwargs)
        if fx_tracer is not None:
            return fx_tracer.create_proxy("call_function", registered_op, args, kwargs)
        return fn(*args, **kwargs)

    op = functools.wraps(fn)(registered_op)
    if not hasattr(fn, "__name__"):  # functools.partial, callable objects
        op.__name__ = op.__qualname__ = op_name
    op.__nnscaler_op__ = annotation  # type: ignore[attr-defined]
    op.op_name = op_name  # type: ignore[attr-defined]
    return cast(RegisteredOp, op)


def _text(annotation: Optional[OpAnnotation]) -> str:
    return annotation.text if annotation is not None else "<nnScaler annotation function>"


def _check_arity(fn: Callable[..., Any], annotation: OpAnnotation) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    kinds = inspect.Parameter
    positional = [p for p in signature.parameters.values()
                  if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind is kinds.VAR_POSITIONAL
                        for p in signature.parameters.values())
    count = len(annotation.inputs)
    where = f"{_short_name(fn)}{signature}"
    if count > len(positional) and not takes_varargs:
        raise AnnotationError(
            f"{count} input annotations but {where} takes {len(positional)} positional "
            f"parameter{'s' if len(positional) != 1 else ''}", annotation.text,
            annotation.inputs[len(positional)].column)
    for param in positional[count:]:
        if param.kind is kinds.POSITIONAL_ONLY and param.default is param.empty:
            raise AnnotationError(
                f"{count} input annotation{'s' if count != 1 else ''} but {where} has a "
                f"positional-only parameter {param.name!r} without default after them: "
                "it can only be passed by position, so it needs an annotation "
                "('?' if it is not a tensor)", annotation.text, annotation.arrow_column)


def _is_module(fn: Any) -> bool:
    torch_nn = sys.modules.get("torch.nn")
    if torch_nn is None:
        return False
    module_type = torch_nn.Module
    return isinstance(fn, module_type) or (isinstance(fn, type) and issubclass(fn, module_type))


def _default_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not isinstance(name, str):
        raise TypeError(f"register_op(): {fn!r} has no __qualname__ to name the op by; "
                        "pass name=")
    return name


def _short_name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or fn)


def _describe(fn: Callable[..., Any]) -> str:
    """`module.qualname (file:line)`, as much of it as `fn` has."""
    module = getattr(fn, "__module__", None)
    name = _short_name(fn)
    text = f"{module}.{name}" if module else name
    code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
    if code is not None:
        text += f" ({code.co_filename}:{code.co_firstlineno})"
    return text


def _same_definition(old: Callable[..., Any], new: Callable[..., Any]) -> bool:
    """Is `new` a redefinition of `old` (same module and qualified name, not a lambda)?"""
    qualname = getattr(new, "__qualname__", None)
    return (isinstance(qualname, str) and not qualname.endswith("<lambda>")
            and getattr(old, "__qualname__", None) == qualname
            and getattr(old, "__module__", None) == getattr(new, "__module__", None))


# -- One registry with Microsoft nnScaler ---------------------------------------------
#
# With nnScaler installed, `attach_nnscaler()` runs when its package is imported (the
# import hook, `_nnscaler_eval_ns`).  From then on `register_op` is nnScaler's (its
# contract whole: every annotation its parser accepts, registration with the return
# value unused, its options), and nnScaler's `CustomizedOps.register`, the one call
# every nnScaler registration goes through, is wrapped so that each function nnScaler
# registers is adopted here too:
#
# - an op of ours registered before nnScaler was imported, handed over then, is only
#   told its nnScaler signature;
# - for a function registered with nnScaler directly, an op of ours (`_make_op`) is
#   made around a copy of the function (same code,
#   globals, defaults, closure: the "body"), named by nnScaler's signature
#   (`module.name`), and put in our registry;
# - the function object itself, which nnScaler's `register_op` returns and user code
#   calls, gets a two-line trampoline as its code (`fn(*a, **k)` -> `op(*a, **k)`), so
#   that a call under our tracer is one opaque node, as for our own ops, and outside a
#   trace runs the body. `fn.__wrapped__` is the body, so `inspect.signature` and
#   `inspect.getsource` (nnScaler's code_impl_pattern='source') see the original.
#
# Functions with closure cells cannot take the trampoline (a code object's free
# variables must match the closure): they stay nnScaler-only and a warning says so.
# `autograd.Function.apply` and script functions are opaque in our captures already.

_nnscaler_attached = False


def _nnscaler_register_op() -> Optional[Callable[..., Any]]:
    """nnScaler's own register_op when nnScaler is installed and attached, else None."""
    if not _nnscaler_attached:
        return None
    return cast(Callable[..., Any], microsoft_nnscaler.module("graph.parser.register").register_op)


def nnscaler_op_signature(op: Any) -> Optional[str]:
    """nnScaler's signature of a registered op of ours (None: not known to nnScaler)."""
    return getattr(op, "__nnscaler_signature__", None)


def nnscaler_runtime_function(op: Any) -> Any:
    """What nnScaler's registry holds for `op` (the function it registered), or None."""
    signature = nnscaler_op_signature(op)
    if signature is None or not _nnscaler_attached:
        return None
    registry = microsoft_nnscaler.module("graph.parser.register").CustomizedOps
    return registry.kOpRuntime.get(signature)


def attach_nnscaler() -> None:
    """Hook nnScaler's op registry into ours (idempotent); adopts ops registered before."""
    nnscaler_registry = microsoft_nnscaler.module("graph.parser.register")
    CustomizedOps = nnscaler_registry.CustomizedOps
    if not _call_holding(_registry_lock, _hook_nnscaler_registry, CustomizedOps):
        return
    for signature, runtime_fn in list(CustomizedOps.kOpRuntime.items()):
        _adopt(signature, runtime_fn, CustomizedOps.kOpMap.get(signature))
    # Ops of ours registered before nnScaler was imported: hand them over now.
    nnscaler_register_op = nnscaler_registry.register_op
    for op in registered_ops().values():
        annotation = getattr(op, "__nnscaler_op__", None)
        if annotation is None or nnscaler_op_signature(op) is not None:
            continue
        try:
            nnscaler_register_op(annotation.text, op.op_name)(op)
        except Exception as exc:  # noqa: BLE001
            op.__nnscaler_refused__ = f"{type(exc).__name__}: {exc}"  # type: ignore[attr-defined]


def _hook_nnscaler_registry(CustomizedOps: Any) -> bool:
    """Route nnScaler's registrations through ours (registry lock held); False when
    that was done already."""
    global _nnscaler_attached
    if _nnscaler_attached:
        return False
    original = CustomizedOps.register
    if not getattr(original, "_nnscaler_eval_hook", False):
        def register(signature: str, op_create_fn: Callable[..., Any], code: str,
                     runtime_fn: Callable[..., Any], emit_fn: Any = None,
                     input_gen_fn: Any = None) -> None:
            original(signature, op_create_fn, code, runtime_fn, emit_fn, input_gen_fn)
            _adopt(signature, runtime_fn, op_create_fn)

        register._nnscaler_eval_hook = True  # type: ignore[attr-defined]
        CustomizedOps.register = staticmethod(register)  # type: ignore[method-assign]
    _nnscaler_attached = True
    return True


def _adopt(signature: str, runtime_fn: Any, op_create_fn: Any) -> None:
    """Make `runtime_fn`, just registered with nnScaler, one opaque node in our captures."""
    if getattr(runtime_fn, "__nnscaler_op__", None) is not None or isinstance(
            getattr(runtime_fn, "op_name", None), str):
        runtime_fn.__nnscaler_signature__ = signature  # one of our ops, handed over by us
        return
    if not isinstance(runtime_fn, types.FunctionType):
        return  # autograd.Function.apply, script functions: opaque in our tracer already
    if getattr(runtime_fn, "__nnscaler_eval_op__", None) is not None:
        return
    name, annotation = None, _annotation_of(op_create_fn)
    if runtime_fn.__closure__:
        warnings.warn(f"register_op(): {_describe(runtime_fn)} uses closure variables, so it "
                      "cannot be made one node in nnscaler-eval captures (nnScaler has it "
                      "registered); define it at module level", stacklevel=4)
        return
    body = types.FunctionType(runtime_fn.__code__, runtime_fn.__globals__,
                              runtime_fn.__name__, runtime_fn.__defaults__, None)
    body.__kwdefaults__ = dict(runtime_fn.__kwdefaults__ or {}) or None
    body.__qualname__ = runtime_fn.__qualname__
    body.__module__ = runtime_fn.__module__
    body.__doc__ = runtime_fn.__doc__
    body.__annotations__ = dict(runtime_fn.__annotations__)
    op_name = name if name is not None else signature
    op = _make_op(body, annotation, op_name)
    op.__nnscaler_signature__ = signature  # type: ignore[attr-defined]
    _call_holding(_registry_lock, _registry.__setitem__, op_name, op)
    runtime_fn.__code__ = _trampoline.__code__
    runtime_fn.__defaults__ = None
    runtime_fn.__kwdefaults__ = {"_nnscaler_eval_op": op}
    runtime_fn.__wrapped__ = body  # type: ignore[attr-defined]
    runtime_fn.__nnscaler_eval_op__ = op  # type: ignore[attr-defined]
    runtime_fn.__nnscaler_op__ = annotation  # type: ignore[attr-defined]
    runtime_fn.op_name = op_name  # type: ignore[attr-defined]


def _trampoline(*args: Any, _nnscaler_eval_op: Any, **kwargs: Any) -> Any:
    return _nnscaler_eval_op(*args, **kwargs)


def _annotation_of(op_create_fn: Any) -> Optional[OpAnnotation]:
    """The annotation string nnScaler's register_op closed over, parsed (None when it is
    an annotation function or our grammar does not read it)."""
    code = getattr(op_create_fn, "__code__", None)
    cells = getattr(op_create_fn, "__closure__", None)
    if code is None or not cells or "annotation" not in code.co_freevars:
        return None
    text = cells[code.co_freevars.index("annotation")].cell_contents
    if not isinstance(text, str):
        return None
    try:
        return parse_annotation(text)
    except AnnotationError:
        return None
