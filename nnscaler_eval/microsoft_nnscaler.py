"""Microsoft nnScaler's modules, imported in one place.

`nnscaler` names two things: Microsoft nnScaler's package, and this project's public
face (`nnscaler_eval/_nnscaler/`, or our names added onto nnScaler's package; see
`_nnscaler_eval_ns.py`). The public face is built on nnscaler_eval, so nnscaler_eval
takes its own names from nnscaler_eval, never from `nnscaler`. The adapter to nnScaler
(parallelize.py, register_op.py's registry hook, _nnscaler_extend.py) does need
Microsoft's modules: it gets each one here, by a path that only Microsoft's
distribution has, and nowhere else in nnscaler_eval imports `nnscaler`
(tests/test_lint.py).

Imports happen on call: nnScaler is optional, and slow to import.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# Modules of Microsoft's distribution that our public package does not have.
MODULES = frozenset({
    "graph.parser",               # to_fx_graph: the seam parallelize() replaces
    "graph.parser.converter",     # _rewrite_inplace_ops, run after our export
    "graph.parser.register",      # nnScaler's op registry and register_op
    "graph.tracer.metadata",      # extract_metadata, for nodes' tensor metadata
    "graph.tracer.frame_utils",   # FrameRecord, for nodes' source frames
    "parallel",                   # parallelize
    "runtime.function.function",  # nnScaler's own ifexpr
})


def module(path: str) -> ModuleType:
    """Microsoft nnScaler's module `nnscaler.<path>`; ImportError without nnScaler."""
    if path not in MODULES:
        raise ValueError(f"nnscaler.{path} is not one of Microsoft nnScaler's own modules")
    return importlib.import_module(f"nnscaler.{path}")


def available() -> bool:
    """Is Microsoft nnScaler installed (its parser importable)?"""
    try:
        module("graph.parser")
    except ImportError:
        return False
    return True
