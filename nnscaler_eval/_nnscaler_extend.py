"""Adds our public names onto Microsoft nnScaler's `nnscaler` package.

Called by the import hook (`_nnscaler_eval_ns`) right after nnScaler's own
`nnscaler/__init__.py` has run. nnScaler's names stay as they are, with one exception:
`register_op`, replaced by ours, which accepts nnScaler's signature, registers with
nnScaler's registry too and returns what nnScaler's returns (see register_op.py).
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
from types import ModuleType

from nnscaler_eval import api

# Names of ours that replace nnScaler's (all others are added only where nnScaler has
# no attribute of that name).
REPLACED = ("register_op",)


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
