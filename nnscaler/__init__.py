"""nnscaler: PEP 523 graph capture of nn.Module.forward, nnScaler style (public API).

    model = nnscaler.compile(model)          # capture, guard, cache, dispatch
    with nnscaler.eval_frame.enable():       # rewrite mode (self.training ifexpr)
        ...
    gm = nnscaler.export(model, x)           # one torch.fx.GraphModule, nnScaler's form
"""
from nnscaler import eval_frame, runtime
from nnscaler_eval.compile_api import compile
from nnscaler_eval.explain import CacheInfo, ExplainReport, cache_info, explain, reset
from nnscaler_eval.export import ExportError, export
from nnscaler_eval.register_op import (
    AnnotationError,
    OpAnnotation,
    parse_annotation,
    register_op,
    registered_ops,
)
from nnscaler_eval.rewrite import rewritten_code, rewritten_function, show_rewrite

__all__ = [
    "compile",
    "eval_frame",
    "runtime",
    "cache_info",
    "CacheInfo",
    "explain",
    "ExplainReport",
    "reset",
    "export",
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
