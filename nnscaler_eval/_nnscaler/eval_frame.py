"""`nnscaler.eval_frame.enable()` / `disable()`: arm or disarm the frame evaluator."""
from nnscaler_eval.eval_frame import disable, enable

__all__ = ["enable", "disable"]
