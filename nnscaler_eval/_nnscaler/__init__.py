"""nnscaler: PEP 523 graph capture of nn.Module.forward, nnScaler style (public API).

    model = nnscaler.compile(model)          # capture, guard, cache, dispatch
    with nnscaler.eval_frame.enable():       # rewrite mode (self.training ifexpr)
        ...
    gm = nnscaler.export(model, x)           # one torch.fx.GraphModule, nnScaler's form

This package is imported as `nnscaler` only when Microsoft nnScaler is not installed
(the import hook in `_nnscaler_eval_ns` decides); with nnScaler installed the same names
are added onto nnScaler's own `nnscaler` package instead.
"""
from nnscaler import eval_frame, runtime
from nnscaler_eval.api import *  # noqa: F401,F403
from nnscaler_eval.api import __all__ as _api_all

__all__ = ["eval_frame", "runtime", *_api_all]
