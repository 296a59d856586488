"""Steady state with block reuse: ours with Inductor, one subgraph per repeated block
against the whole graph inlined (issue 33's goal: at most x1.03), beside eager.

    .venv/bin/python -m benchmarks.block_reuse_steady [--layers 12] [--repeats 9]

The GPT of benchmarks/models.py (d=128, 4 heads, sequence 64).  eval: batch 1,
`eval()`, one forward under no_grad; train: batch 8, forward and backward (the
gradients are zeroed outside the timed region; no optimizer step, so both systems
time the compiled code only).  Both compiled systems are compiled and warmed up
first; then `--repeats` rounds, each timing every system for at least 0.2 s in a
rotated order (interleaved); per-call medians, and ratios of the medians of the same
run.  One intra-op thread.  Prints a Markdown table; writes nothing.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from typing import Any, Callable

import torch

import nnscaler
from benchmarks import models


def _timed(step: Callable[[], Any], budget: float = 0.2) -> float:
    """Seconds per call of `step`, over at least `budget` seconds."""
    calls, start = 0, time.perf_counter()
    while True:
        step()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget:
            return elapsed / calls


def _steps(mode: str, layers: int) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    cfg = models.GPTConfig(layers=layers, seq=64, dim=128, heads=4)
    base = models.GPT(cfg)
    x = torch.randint(0, cfg.vocab, (1 if mode == "eval" else 8, cfg.seq),
                      generator=torch.Generator().manual_seed(1))
    systems = {
        "eager": copy.deepcopy(base),
        "ours, block reuse": nnscaler.compile(copy.deepcopy(base), backend="inductor"),
        "ours, whole graph": nnscaler.compile(copy.deepcopy(base), backend="inductor",
                                              block_reuse=False),
    }
    steps: dict[str, Callable[[], Any]] = {}
    for name, model in systems.items():
        model.train(mode == "train")
        if mode == "eval":
            def step(model: Any = model) -> Any:
                with torch.no_grad():
                    return model(x)
        else:
            def step(model: Any = model) -> Any:
                model.zero_grad(set_to_none=True)
                model(x).float().sum().backward()
        steps[name] = step
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--modes", default="eval,train")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"1 torch thread; Python {platform.python_version()}, torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.2f}\n")
    print(f"{args.layers}-block GPT, {args.repeats} interleaved rounds, median per call.\n")
    print("| mode | eager ms | ours, block reuse ms | ours, whole graph ms | "
          "reuse / whole graph | reuse / eager |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        steps = _steps(mode, args.layers)
        for step in steps.values():   # compile and warm up
            for _ in range(3):
                step()
        names = list(steps)
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(_timed(steps[name]))
        med = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        reuse, whole, eager = med["ours, block reuse"], med["ours, whole graph"], med["eager"]
        print(f"| {mode} | {eager:.3f} | {reuse:.3f} | {whole:.3f} | x{reuse / whole:.3f} | "
              f"x{reuse / eager:.3f} |", flush=True)


if __name__ == "__main__":
    main()
