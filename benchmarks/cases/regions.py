"""9. Regions in a loop: `with nnscaler.eval_frame.enable(backend="eager"):` around each
step, as a user writes it, against eager and against one region object kept and
re-entered.

A two-layer module (Linear 64 -> 64, ReLU, Linear 64 -> 64), batch 4, no_grad.  One
iteration is one `with` block holding one call (the block's enter and exit are part of
what is timed on both region variants; eager has no block).  Reported: us per
iteration, medians over interleaved repeats, and the captures each variant made over
the whole run (a region whose caches died with it would capture in every block).
The Dynamo side has no region to compare: `torch.compile` has no context manager that
captures the forwards called inside it.
"""
from __future__ import annotations

import torch
from torch import nn

from benchmarks.harness import Loop, Row, Settings, Variant, measure
from benchmarks.variants import nnscaler_module, reset_all

NAME = "regions"
TITLE = "enable(backend=...) blocks in a loop (us per iteration)"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def _loop(kind: str, model: nn.Module, x: torch.Tensor) -> Loop:
    if kind == "eager":
        def loop(n: int) -> None:
            for _ in range(n):
                model(x)
        return loop
    enable = nnscaler_module().eval_frame.enable
    if kind == "ours: a new `with enable()` block per step":
        def loop(n: int) -> None:
            for _ in range(n):
                with enable(backend="eager"):
                    model(x)
        return loop
    region = enable(backend="eager")

    def loop(n: int) -> None:
        for _ in range(n):
            with region:
                model(x)
    return loop


KINDS = ["eager", "ours: a new `with enable()` block per step", "ours: one region kept"]


def run(settings: Settings) -> list[Row]:
    reset_all()
    x = torch.randn(4, 64)
    models: dict[str, nn.Module] = {}

    def setup(kind: str) -> Loop:
        models[kind] = _model()
        return _loop(kind, models[kind], x)

    variants = [Variant(kind, lambda kind=kind: setup(kind), context=torch.no_grad)
                for kind in KINDS]
    rows = measure(NAME, "two-layer module, batch 4, no_grad", variants, settings, unit="us",
                   params={"model": "Linear(64,64)-ReLU-Linear(64,64)", "batch": 4})
    info = nnscaler_module().cache_info
    for row in rows:
        if row.variant != "eager" and row.variant in models:
            captures = sum(info(m).captures for m in models[row.variant].modules())
            row.params["captures over the run"] = captures
            row.note = f"captures over the run: {captures}"
    reset_all()
    return rows

