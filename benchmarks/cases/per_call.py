"""2. Per-call overhead on tiny workloads, where the compiler's dispatch dominates.

nn.Identity, nn.Linear(8, 8) and a function `x + 1`, batch 1, under `torch.no_grad()`
and with grad mode on (the Linear's parameters then record autograd history).
Unit: microseconds per call; the report adds the overhead over eager (difference of
medians) and the ratio.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from benchmarks.harness import Loop, Row, Settings, Variant, make_loop, measure
from benchmarks.variants import compile_variant, first_call, reset_all, variant_names

NAME = "per_call"
TITLE = "Per-call overhead, batch 1 (us per call)"


def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


TARGETS: dict[str, Callable[[], Any]] = {
    "nn.Identity": nn.Identity,
    "nn.Linear(8,8)": lambda: nn.Linear(8, 8),
    "fn x + 1": lambda: add_one,
}
MODES = {"no_grad": torch.no_grad, "grad": torch.enable_grad}


def _setup(make: Callable[[], Any], variant: str, x: torch.Tensor) -> Loop:
    compiled = compile_variant(make(), variant)
    first_call(variant, compiled, lambda: compiled(x))
    return make_loop(compiled, x)


def run(settings: Settings) -> list[Row]:
    rows: list[Row] = []
    for target, make in TARGETS.items():
        for mode, context in MODES.items():
            reset_all()
            torch.manual_seed(0)
            x = torch.randn(1, 8)
            variants = [Variant(v, lambda v=v: _setup(make, v, x), context=context)
                        for v in variant_names(settings)]
            rows += measure(NAME, f"{target}, {mode}", variants, settings, unit="us",
                            params={"target": target, "grad_mode": mode})
    reset_all()
    return rows
