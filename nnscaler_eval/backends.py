"""Backends: what turns a captured graph into the callable run on a cache hit.

A backend is what `torch.compile` accepts: a callable `backend(gm, example_inputs)
-> callable`, or a name.  "eager" (the default) is handled here without torch._dynamo:
the graph becomes straight-line generated Python (nnscaler_eval.codegen), which runs
CPU kernels on CPU tensors and CUDA kernels on CUDA tensors.  Any other name is looked
up in torch's backend registry ("inductor", "aot_eager", "cudagraphs", ...).
"""
from __future__ import annotations

from typing import Any, Callable, Optional


def resolve_backend(backend: Any) -> tuple[Optional[Callable[..., Any]], str]:
    """(callable or None for eager, display name); raises a clear error for bad input."""
    if backend is None or backend == "eager":
        return None, "eager"
    if isinstance(backend, str):
        from torch._dynamo.backends.registry import list_backends, lookup_backend

        try:
            return lookup_backend(backend), backend
        except Exception as exc:  # torch raises InvalidBackend
            known = ", ".join(["eager"] + sorted(set(list_backends(exclude_tags=())) - {"eager"}))
            raise ValueError(
                f"nnscaler.compile(): unknown backend {backend!r}; known backends: {known}"
            ) from exc
    if callable(backend):
        return backend, getattr(backend, "__name__", type(backend).__name__)
    raise TypeError(
        f"nnscaler.compile(): backend must be a name or a callable(gm, example_inputs), "
        f"not {type(backend).__name__}"
    )
