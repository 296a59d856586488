"""Adds our public names onto Microsoft nnScaler's `nnscaler` package.

Called by the import hook (`_nnscaler_eval_ns`) right after nnScaler's own
`nnscaler/__init__.py` has run. nnScaler's names stay as they are: `register_op` is
nnScaler's own, whose registry hands each function to ours (register_op.py), so that
installing us changes nothing of nnScaler's contract.
`nnscaler.runtime.function.ifexpr` stays nnScaler's (same semantics); the bytecode
rewrite calls `nnscaler_eval.runtime.ifexpr`, which exports map to nnScaler's.

On nnScaler's package `nnscaler.export` is `export_for_nnscaler`: the graph in the form
nnScaler's parser consumes (forms it cannot express raise ExportError). Our own form
(training flags as inputs, `torch.cond` kept) stays `nnscaler_eval.export.export`.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types
from types import ModuleType
from typing import Any

from nnscaler_eval import api, microsoft_nnscaler, runtime

# Names of ours that replace nnScaler's: none (ours are added only where nnScaler has
# no attribute of that name).
REPLACED: tuple[str, ...] = ()


def extend(package: ModuleType) -> None:
    from nnscaler_eval import register_op as register_op_module

    register_op_module.attach_nnscaler()
    for name in api.__all__:
        if name in REPLACED or not hasattr(package, name):
            setattr(package, name, getattr(api, name))
    if getattr(package, "export", None) is api.export:
        package.export = api.export_for_nnscaler
    package.__dict__.setdefault("__nnscaler_eval_names__", tuple(api.__all__))
    _add_eval_frame(package)
    _route_nnscaler_ifexpr()
    _route_nnscaler_leaves()


def _route_nnscaler_ifexpr() -> None:
    """nnScaler's `ifexpr`, called explicitly in user code (`nnscaler.runtime.function
    .ifexpr(self.training, a, b)`, as nnScaler's docs write it), becomes an ifexpr node
    in our captures instead of being traced through (which would specialise the graph
    on the flag). Its function object keeps its identity, module and name (nnScaler's
    parser and tracer find it by those) and gets a one-line trampoline as its code,
    calling ours, which outside a trace is `true_value if cond else false_value`, the
    same as nnScaler's body (kept as `__wrapped__`)."""
    runtime_function = microsoft_nnscaler.module("runtime.function.function")
    fn = getattr(runtime_function, "ifexpr", None)
    if (not isinstance(fn, types.FunctionType) or fn.__closure__
            or getattr(fn, "__nnscaler_eval_routed__", False)):
        return
    body = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__)
    body.__qualname__, body.__module__, body.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    fn.__code__ = _ifexpr_trampoline.__code__
    fn.__defaults__ = None
    fn.__kwdefaults__ = {"_nnscaler_eval_ifexpr": api.ifexpr}
    fn.__wrapped__ = body  # type: ignore[attr-defined]
    fn.__nnscaler_eval_routed__ = True  # type: ignore[attr-defined]


def _ifexpr_trampoline(cond: Any, true_value: Any, false_value: Any, *,
                       _nnscaler_eval_ifexpr: Any) -> Any:
    return _nnscaler_eval_ifexpr(cond, true_value, false_value)


# nnScaler's runtime functions its tracer keeps as leaves (besides ifexpr), that our
# captures must keep as nodes too when they export for nnScaler.
LEAVES = ("fold_constant",)


def _route_nnscaler_leaves() -> None:
    """Each of LEAVES gets a trampoline as its code, as ifexpr does: one node of the
    function itself in an export for nnScaler (runtime.nnscaler_leaf), its own body
    (kept as `__wrapped__`) everywhere else."""
    runtime_function = microsoft_nnscaler.module("runtime.function.function")
    for name in LEAVES:
        fn = getattr(runtime_function, name, None)
        if (not isinstance(fn, types.FunctionType) or fn.__closure__
                or getattr(fn, "__nnscaler_eval_routed__", False)):
            continue
        body = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__)
        body.__kwdefaults__ = fn.__kwdefaults__
        body.__qualname__, body.__module__, body.__doc__ = (fn.__qualname__, fn.__module__,
                                                            fn.__doc__)
        fn.__code__ = _leaf_trampoline.__code__
        fn.__defaults__ = None
        fn.__kwdefaults__ = {"_nnscaler_eval_leaf": (runtime.nnscaler_leaf, fn, body)}
        fn.__wrapped__ = body  # type: ignore[attr-defined]
        fn.__nnscaler_eval_routed__ = True  # type: ignore[attr-defined]


def _leaf_trampoline(*args: Any, _nnscaler_eval_leaf: Any, **kwargs: Any) -> Any:
    call, target, body = _nnscaler_eval_leaf
    return call(target, body, *args, **kwargs)


def _add_eval_frame(package: ModuleType) -> None:
    """`nnscaler.eval_frame` (enable/disable): our file, as a submodule of theirs."""
    name = package.__name__ + ".eval_frame"
    if name in sys.modules:
        setattr(package, "eval_frame", sys.modules[name])
        return
    path = os.path.join(os.path.dirname(__file__), "_nnscaler", "eval_frame.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    setattr(package, "eval_frame", module)
