"""Hands the C core the Python objects it needs; run once when nnscaler_eval is imported
(the objects themselves live in shared_objects.py, below everything that uses them)."""
from __future__ import annotations

import torch

from nnscaler_eval import _C
from nnscaler_eval.capture.branches import capture_code
from nnscaler_eval.convert_frame import convert_frame
from nnscaler_eval.runtime import ifexpr
from nnscaler_eval.shared_objects import (
    INTERNAL_PREFIX,
    REWRITE_MODE,
    RUN_DISARMED,
    RUN_EAGERLY,
    global_hook_dicts,
)


def install() -> None:
    _C.install(
        ifexpr,
        convert_frame,
        REWRITE_MODE,
        RUN_EAGERLY,
        RUN_DISARMED,
        torch.nn.Module,
        torch._C.TensorBase,
        torch.is_grad_enabled,
        global_hook_dicts(),
        INTERNAL_PREFIX,
        torch._C._len_torch_function_stack,
        torch._C._pop_torch_function_stack,
    )
    _C.set_capture_code(capture_code)
    _C.set_hooked_call(
        torch.nn.modules.module,
        torch.nn.Module.__dict__["_wrapped_call_impl"],
        torch.nn.Module.__dict__["_call_impl"],
        torch._C._get_tracing_state,
    )
