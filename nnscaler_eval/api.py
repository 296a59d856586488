"""The public names users reach as `nnscaler.<name>`, in one place.

`nnscaler` is Microsoft nnScaler's package name too, so this distribution does not own
a `nnscaler/` directory (see `_nnscaler_eval_ns.py` at the top level): when nnScaler is
installed these names are added onto its package, otherwise a package of ours
(`nnscaler_eval/_nnscaler/`) is imported under that name. Both read them from here.
"""
from __future__ import annotations

from nnscaler_eval import eval_frame
from nnscaler_eval.compile_api import compile
from nnscaler_eval.capture.dynamic import mark_dynamic, mark_static
from nnscaler_eval.tools.explain import CacheInfo, ExplainReport, cache_info, explain, reset
from nnscaler_eval.export import ExportError, export
from nnscaler_eval.parallelize import export_for_nnscaler
from nnscaler_eval.register_op import (
    AnnotationError,
    OpAnnotation,
    parse_annotation,
    register_op,
    registered_ops,
)
from nnscaler_eval.rewrite import rewritten_code, rewritten_function, show_rewrite
from nnscaler_eval.runtime import ifexpr

__all__ = [
    "compile",
    "mark_dynamic",
    "mark_static",
    "cache_info",
    "CacheInfo",
    "explain",
    "ExplainReport",
    "reset",
    "export",
    "export_for_nnscaler",
    "ExportError",
    "rewritten_code",
    "rewritten_function",
    "show_rewrite",
    "register_op",
    "registered_ops",
    "parse_annotation",
    "OpAnnotation",
    "AnnotationError",
]
# `eval_frame` and `runtime` are submodules of `nnscaler` (nnscaler.eval_frame.enable(),
# nnscaler.runtime.function.ifexpr); `ifexpr` is re-exported for the runtime package.
_ = (eval_frame, ifexpr)
