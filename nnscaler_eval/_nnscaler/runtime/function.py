"""`nnscaler.runtime.function`: functions that rewritten bytecode and graphs call."""
from nnscaler_eval.runtime import ifexpr

__all__ = ["ifexpr"]
