"""The compared systems, and how each one compiles a module or a function.

Every variant gets its own copy of the module (same weights): `nnscaler.compile`
compiles in place, and Dynamo's caches live on code objects, so sharing one instance
would let one system's state leak into another's timings.
"""
from __future__ import annotations

import copy
import types
from typing import Any, Callable

import torch

from benchmarks.harness import NotAvailable, Settings, error_text

EAGER = "eager"
DYNAMO = "dynamo"
AOT_EAGER = "aot_eager"
INDUCTOR = "inductor"
OURS = "ours"
OURS_INDUCTOR = "ours-inductor"

LABELS = {
    EAGER: "eager PyTorch",
    DYNAMO: 'torch.compile(backend="eager") (Dynamo alone)',
    AOT_EAGER: 'torch.compile(backend="aot_eager")',
    INDUCTOR: "torch.compile() (Inductor, CPU)",
    OURS: 'nnscaler.compile(backend="eager")',
    OURS_INDUCTOR: 'nnscaler.compile(backend="inductor")',
}
ORDER = [EAGER, DYNAMO, AOT_EAGER, INDUCTOR, OURS, OURS_INDUCTOR]


def configure_dynamo() -> None:
    """Room for every variant's entries: several backends and grad modes share one code
    object's cache list in Dynamo, and its default limit (8) would silently send later
    variants to eager.  Recorded in the report."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096


DYNAMO_CONFIG_NOTE = ("torch._dynamo.config.recompile_limit = 64 and "
                      "accumulated_recompile_limit = 4096 (defaults 8 / 256), so that "
                      "no variant falls back to eager because others filled the cache")


def variant_names(settings: Settings, dynamo_side: bool = True) -> list[str]:
    names = [EAGER]
    if dynamo_side:
        names += [DYNAMO, AOT_EAGER]
        if settings.inductor:
            names.append(INDUCTOR)
    names.append(OURS)
    if settings.inductor:
        names.append(OURS_INDUCTOR)
    return names


def nnscaler_module() -> Any:
    """The public package, or NotAvailable when it does not import."""
    try:
        import nnscaler
    except Exception as exc:
        raise NotAvailable(f"import nnscaler failed: {error_text(exc)}") from exc
    return nnscaler


def copy_function(fn: types.FunctionType, tag: str) -> types.FunctionType:
    """`fn` with its own code object (own caches for Dynamo and for us)."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    new = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = f"{fn.__qualname__}_{tag}"
    return new


def compile_variant(obj: Any, variant: str, dynamic: Any = None, **ours_options: Any) -> Any:
    """`obj` (a module: deep-copied first; or a function: code copied) compiled by
    `variant`.  Raises NotAvailable when the compiler is unusable."""
    if isinstance(obj, torch.nn.Module):
        obj = copy.deepcopy(obj)
    elif isinstance(obj, types.FunctionType):
        obj = copy_function(obj, variant.replace("-", "_"))
    if variant == EAGER:
        return obj
    if variant in (DYNAMO, AOT_EAGER, INDUCTOR):
        backend = {DYNAMO: "eager", AOT_EAGER: "aot_eager", INDUCTOR: "inductor"}[variant]
        return torch.compile(obj, backend=backend, dynamic=dynamic)
    if variant in (OURS, OURS_INDUCTOR):
        nnscaler = nnscaler_module()
        backend = "inductor" if variant == OURS_INDUCTOR else "eager"
        if "ours_dynamic" in ours_options:   # `dynamic` itself is torch.compile's
            ours_options = dict(ours_options, dynamic=ours_options.pop("ours_dynamic"))
        try:
            return nnscaler.compile(obj, backend=backend, **ours_options)
        except Exception as exc:
            raise NotAvailable(f"nnscaler.compile failed: {error_text(exc)}") from exc
    raise KeyError(variant)


def first_call(variant: str, compiled: Any, call: Callable[[], Any]) -> Any:
    """Run the first (capturing) call, and for ours check that a graph was captured
    and is used: a variant that silently runs eagerly is reported unavailable."""
    if variant not in (OURS, OURS_INDUCTOR):
        return call()
    nnscaler = nnscaler_module()
    try:
        result = call()
    except Exception as exc:
        raise NotAvailable(f"first call failed: {error_text(exc)}") from exc
    info = nnscaler.cache_info(compiled)
    if info.captures == 0 or info.entries == 0:
        raise NotAvailable(f"no graph captured on the first call ({info})")
    call()
    after = nnscaler.cache_info(compiled)
    if after.hits <= info.hits:
        raise NotAvailable(f"second call was not a cache hit ({info} -> {after})")
    return result


def dynamo_graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def reset_all() -> None:
    """Forget every compiled artefact of both systems (between sub-benchmarks)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        nnscaler_module().reset()
    except NotAvailable:
        pass
