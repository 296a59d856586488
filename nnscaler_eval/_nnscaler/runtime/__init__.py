"""Runtime functions that captured graphs and rewritten code call."""
from nnscaler.runtime import function  # noqa: F401
