"""4. Lookup with many cache entries: 1 to 8 cached input shapes, hit on the last.

One Linear+ReLU block (a user module), inputs of shape (b, 8) for b = 1..N, no_grad.
The loop calls the shapes round-robin.  Both caches keep entries most recently used
first, so calling N shapes in turn makes every lookup walk past the N - 1 other
entries and hit the last one: the worst case of a linear lookup.  Dynamo runs with
`dynamic=False` (one entry per shape, as ours); with its default automatic dynamic
shapes it would hold one dynamic entry instead.  Unit: us per call.
"""
from __future__ import annotations

from typing import Any

import torch

from benchmarks import models
from benchmarks.harness import Loop, NotAvailable, Row, Settings, Variant, measure
from benchmarks.variants import compile_variant, first_call, nnscaler_module, reset_all

NAME = "lookup"
TITLE = "Lookup among N cached shapes, hit on the last (us per call)"


def round_robin(fn: Any, xs: list) -> Loop:
    def loop(n: int) -> None:
        for _ in range(n):
            for x in xs:
                fn(x)
    return loop


def run(settings: Settings) -> list[Row]:
    rows: list[Row] = []
    counts = [1, 2, 4, 8] if settings.quick else list(range(1, 9))
    reset_all()
    torch.manual_seed(0)
    base = models.multi_input_stack(1, 1)     # a class of its own: a clean code object
    inputs = [torch.randn(b, 8) for b in range(1, max(counts) + 1)]
    built: dict[str, Any] = {}

    def get(variant: str) -> Any:
        if variant not in built:
            try:
                if variant == "dynamo":
                    built[variant] = compile_variant(base, variant, dynamic=False)
                elif variant == "ours":
                    c = compile_variant(base, variant, cache_size_limit=max(8, max(counts)))
                    first_call(variant, c, lambda: c(inputs[0]))
                    built[variant] = c
                else:
                    built[variant] = compile_variant(base, variant)
            except Exception as exc:
                built[variant] = exc
        if isinstance(built[variant], Exception):
            raise NotAvailable(str(built[variant]))
        return built[variant]

    for n in counts:
        xs = inputs[:n]

        def setup(variant: str, xs: list = xs) -> Loop:
            c = get(variant)
            for x in xs:               # captures the shapes not seen yet
                c(x)
            if variant == "ours":
                info = nnscaler_module().cache_info(c)
                if info.entries != len(xs) or info.fallbacks:
                    raise NotAvailable(f"expected {len(xs)} entries, got {info}")
            if variant == "dynamo":
                from torch._dynamo.eval_frame import _debug_get_cache_entry_list
                found = len(_debug_get_cache_entry_list(type(c._orig_mod).forward.__code__))
                if found != len(xs):
                    raise NotAvailable(f"expected {len(xs)} Dynamo entries, found {found}")
            return round_robin(c, xs)

        variants = [Variant(v, lambda v=v: setup(v), context=torch.no_grad)
                    for v in ("eager", "dynamo", "ours")]
        rows += measure(NAME, f"{n} entr{'y' if n == 1 else 'ies'}", variants, settings,
                        unit="us", per_iteration=n, params={"entries": n})
    reset_all()
    return rows
