"""7. Steady state: time per step once everything is captured and compiled.

MLP, 2-layer and 12-layer small GPTs (benchmarks/models.py) at batch 1, 8 and 64:
- no_grad: eval() and `torch.no_grad()`, one forward;
- fwd+bwd: train() (dropout on), forward, `out.float().mean().backward()`, and
  `zero_grad(set_to_none=True)`, the same for every variant.
One compiled object per (model, mode) serves all batch sizes, as in real use:
Dynamo recompiles once with dynamic shapes (its default), ours captures one static
graph per batch size.  The Inductor variants run at batch 8 only, and not on the
12-layer GPT (compile budget).  Unit: ms per step; ratio to eager.
"""
from __future__ import annotations

from typing import Any

import torch

from benchmarks import models
from benchmarks.harness import Loop, NotAvailable, Row, Settings, Variant, measure
from benchmarks.variants import (
    INDUCTOR, OURS_INDUCTOR, compile_variant, first_call, reset_all, variant_names,
)

NAME = "steady_state"
TITLE = "Steady state (ms per step)"


def plan(settings: Settings) -> tuple[list[str], list[int], list[str]]:
    if settings.quick:
        return ["mlp", "gpt2"], [1, 8], ["no_grad", "fwd+bwd"]
    return ["mlp", "gpt2", "gpt12"], [1, 8, 64], ["no_grad", "fwd+bwd"]


# Inductor's cold compiles take minutes per graph on a 2-core machine (ours-inductor
# compiles one graph per batch size, Dynamo a static and a dynamic one): Inductor runs
# at batch 8 only, and not on the 12-layer GPT, to keep `make bench` in its budget.
INDUCTOR_MODELS = {"mlp", "gpt2"}
INDUCTOR_BATCHES = {8}


def step_loop(compiled: Any, model: torch.nn.Module, inputs: tuple, mode: str) -> Loop:
    if mode == "no_grad":
        def loop(n: int) -> None:
            for _ in range(n):
                compiled(*inputs)
        return loop

    def train_loop(n: int) -> None:
        for _ in range(n):
            compiled(*inputs).float().mean().backward()
            model.zero_grad(set_to_none=True)
    return train_loop


def run(settings: Settings) -> list[Row]:
    model_names, batches, modes = plan(settings)
    rows: list[Row] = []
    for name in model_names:
        for mode in modes:
            reset_all()
            base, _ = models.build(name, 1)
            base.train(mode == "fwd+bwd")
            names = variant_names(settings)
            if name not in INDUCTOR_MODELS:
                names = [v for v in names if v not in (INDUCTOR, OURS_INDUCTOR)]
            built: dict[str, Any] = {}
            context = torch.no_grad if mode == "no_grad" else torch.enable_grad

            def get(variant: str, inputs: tuple) -> tuple[Any, torch.nn.Module]:
                if variant not in built:
                    try:
                        compiled = compile_variant(base, variant)
                        first_call(variant, compiled, lambda: compiled(*inputs))
                        model = getattr(compiled, "_orig_mod", compiled)
                        built[variant] = (compiled, model)
                    except Exception as exc:
                        built[variant] = exc
                if isinstance(built[variant], Exception):
                    raise NotAvailable(str(built[variant]))
                return built[variant]

            for batch in batches:
                _, inputs = models.build(name, batch)

                def setup(variant: str, inputs: tuple = inputs) -> Loop:
                    compiled, model = get(variant, inputs)
                    return step_loop(compiled, model, inputs, mode)

                here = [v for v in names
                        if v not in (INDUCTOR, OURS_INDUCTOR) or batch in INDUCTOR_BATCHES]
                variants = [Variant(v, lambda v=v: setup(v), context=context) for v in here]
                rows += measure(NAME, f"{name}, batch {batch}, {mode}", variants, settings,
                                unit="ms", params={"model": name, "batch": batch,
                                                   "mode": mode,
                                                   "description": models.MODEL_DESCRIPTIONS[name]})
            for variant in (INDUCTOR, OURS_INDUCTOR):
                if settings.inductor and variant not in names:
                    rows.append(Row(NAME, f"{name}, batch 8, {mode}", variant, "ms",
                                    status="skipped",
                                    error="Inductor cold compiles of this model take minutes "
                                          "per graph here; left out of make bench"))
    reset_all()
    return rows
