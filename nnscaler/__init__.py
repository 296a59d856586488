"""nnscaler: PEP 523 graph capture of nn.Module.forward, nnScaler style (public API)."""
from nnscaler import runtime  # noqa: F401
