"""6. Recaptures: how many graphs each system captures in common workflows.

- 100 train/eval toggles: a transformer block (nn.Dropout modules and
  `F.scaled_dot_product_attention(dropout_p=self.p if self.training else 0.0)`),
  train() call, eval() call, 100 times, grad mode fixed (no_grad) so that only the
  training flag changes;
- a forward hook added to a submodule and removed again: MLP, 2 calls, hook added,
  2 calls, hook removed, 2 calls.  Also counts the hook's own calls (2 expected: a
  system that does not notice the hook silently skips it);
- batch sizes 1 -> 8 -> 1 (-> 8 -> 1): MLP.
Counted: for ours, `nnscaler.cache_info(m).captures` (summed over the submodules'
forwards) with the default backend "eager"; for Dynamo, the graphs a counting backend
(`backend(gm, example_inputs)` that counts and returns `gm.forward`) received.
"ours (callable backend)" gives ours that counting backend instead: a compiled backend
gets graphs with the training flags folded in and guarded, so it is what ours does
under torch.compile backends such as Inductor.  One run each (the counts are
deterministic).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from benchmarks import models
from benchmarks.harness import NotAvailable, Row, Settings, error_text
from benchmarks.variants import nnscaler_module, reset_all

NAME = "recaptures"
TITLE = "Recaptures in common workflows (graphs captured)"


class CountingBackend:
    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1
        return gm.forward


def _compile(kind: str, model: torch.nn.Module, backend: CountingBackend) -> Any:
    if kind.startswith("ours"):
        nnscaler = nnscaler_module()
        try:
            return nnscaler.compile(model,
                                    backend=backend if "callable" in kind else "eager",
                                    skip_nnmodule_hook_guards="skip hook" in kind)
        except Exception as exc:
            raise NotAvailable(f"nnscaler.compile failed: {error_text(exc)}") from exc
    dynamic = False if "dynamic=False" in kind else None
    return torch.compile(model, backend=backend, dynamic=dynamic)


def toggles(compiled: Any, model: torch.nn.Module, inputs: tuple, n: int) -> None:
    with torch.no_grad():
        for _ in range(n):
            model.train()
            compiled(*inputs)
            model.eval()
            compiled(*inputs)


def hook_added_removed(compiled: Any, model: torch.nn.Module, inputs: tuple) -> int:
    calls = 0

    def hook(module: Any, args: Any, output: Any) -> None:
        nonlocal calls
        calls += 1

    with torch.no_grad():
        compiled(*inputs)
        compiled(*inputs)
        handle = model.body[0].register_forward_hook(hook)
        compiled(*inputs)
        compiled(*inputs)
        handle.remove()
        compiled(*inputs)
        compiled(*inputs)
    return calls


def batch_sizes(compiled: Any, model: torch.nn.Module, sizes: list[int]) -> None:
    with torch.no_grad():
        for b in sizes:
            compiled(torch.randn(b, 128))


SCENARIOS = ["100 train/eval toggles", "forward hook added, removed", "batch 1 -> 8 -> 1 -> 8 -> 1"]
KINDS = {
    "100 train/eval toggles": ["ours", "ours (callable backend)", "dynamo"],
    "forward hook added, removed": ["ours", "ours (skip hook guards)", "dynamo",
                                    "dynamo (hook guards on)"],
    "batch 1 -> 8 -> 1 -> 8 -> 1": ["ours", "dynamo", "dynamo (dynamic=False)"],
}


def run_one(scenario: str, kind: str, quick: bool) -> dict[str, Any]:
    import torch._dynamo

    reset_all()
    backend = CountingBackend()
    out: dict[str, Any] = {}
    old_hook_guards = torch._dynamo.config.skip_nnmodule_hook_guards
    if kind == "dynamo (hook guards on)":
        torch._dynamo.config.skip_nnmodule_hook_guards = False
    try:
        t0 = time.perf_counter()
        if scenario.startswith("100"):
            model, inputs = models.build("block", 2)
            compiled = _compile(kind, model, backend)
            toggles(compiled, model, inputs, 100)
        elif scenario.startswith("forward hook"):
            model, inputs = models.build("mlp", 2)
            compiled = _compile(kind, model, backend)
            out["hook calls (2 expected)"] = hook_added_removed(compiled, model, inputs)
        else:
            model, _ = models.build("mlp", 1)
            compiled = _compile(kind, model, backend)
            batch_sizes(compiled, model, [1, 8, 1, 8, 1])
        out["seconds"] = time.perf_counter() - t0
    finally:
        torch._dynamo.config.skip_nnmodule_hook_guards = old_hook_guards
    out["backend graphs"] = backend.graphs
    if kind.startswith("ours"):
        info = nnscaler_module().cache_info(compiled)
        out["cache_info.captures"] = info.captures
        out["cache_info"] = list(info)
    return out


def run(settings: Settings) -> list[Row]:
    rows: list[Row] = []
    for scenario in SCENARIOS:
        for kind in KINDS[scenario]:
            try:
                out = run_one(scenario, kind, settings.quick)
            except Exception as exc:
                rows.append(Row(NAME, f"{scenario}: graphs", kind, "count",
                                status="not available", error=error_text(exc)))
                continue
            params = {"scenario": scenario, "seconds": out["seconds"],
                      "cache_info": out.get("cache_info"),
                      "backend_graphs": out["backend graphs"]}
            graphs = out.get("cache_info.captures", out["backend graphs"])
            row = _count_row(f"{scenario}: graphs", kind, graphs, params)
            row.note = ("nnscaler.cache_info(m).captures" if kind.startswith("ours")
                        else "graphs given to a counting backend")
            if "callable" in kind and out["backend graphs"] != graphs:
                row.note += f"; the counting backend received {out['backend graphs']}"
            rows.append(row)
            if "hook calls (2 expected)" in out:
                rows.append(_count_row(f"{scenario}: hook calls (2 expected)", kind,
                                       out["hook calls (2 expected)"], params))
    reset_all()
    return rows


def _count_row(bench: str, variant: str, value: float, params: dict) -> Row:
    return Row(NAME, bench, variant, "count", median=value, p10=value, p90=value, n=1,
               loops=1, samples=[value], params=dict(params))
