"""Training with Inductor: compile time per step and steady step time, side by side.

    .venv/bin/python -m benchmarks.inductor_training [--quick] [--layers N] [--batch B]

The 12-block GPT of benchmarks/models.py (train mode, dropout on), AdamW, steps of
forward + `loss.backward()` + `opt.step()` + `zero_grad()`:
- ours: `nnscaler.compile(m, backend="inductor")`;
- `torch.compile(m)` (Inductor, its defaults).
Neither compiles the optimizer step (the user compiled the module only).

Compile times: each system's first two steps run in a fresh process of its own, with
an empty Inductor cache directory and the FX graph and AOTAutograd caches off, so that
neither reuses the other's kernels, and Inductor compiling in the process itself
(`TORCHINDUCTOR_COMPILE_THREADS=1`); CPU time (the process and the C++ compiler it
ran) and wall time of step 1 and step 2.
A system that compiles everything at step 1 shows step 2 at its steady time.

Steady state: both systems in one process (compiled again there, not timed), then
rounds of `--steps` steps each, the systems interleaved in a rotated order; median
milliseconds per step (thread CPU time) and the ratio ours / torch.compile().
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch


def _model(layers: int) -> torch.nn.Module:
    from benchmarks import models

    torch.manual_seed(0)
    return models.GPT(models.GPTConfig(layers=layers, seq=64)).train()


def _system(name: str, model: torch.nn.Module) -> torch.nn.Module:
    if name == "ours":
        import nnscaler

        return nnscaler.compile(model, backend="inductor")
    return torch.compile(model)


def _stepper(name: str, layers: int, batch: int) -> Callable[[], None]:
    model = _model(layers)
    compiled = _system(name, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (batch, 64), generator=gen)

    def step() -> None:
        compiled(x).float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _cpu() -> float:
    """CPU seconds of this process and of its finished children (the C++ compiler)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _first_steps(name: str, layers: int, batch: int) -> dict[str, float]:
    """In this (fresh) process: CPU and wall seconds of steps 1 and 2."""
    step = _stepper(name, layers, batch)
    out: dict[str, float] = {}
    for i in (1, 2):
        wall, cpu = time.perf_counter(), _cpu()
        step()
        out[f"step{i}_cpu"] = _cpu() - cpu
        out[f"step{i}_wall"] = time.perf_counter() - wall
    return out


def _fresh_process(name: str, layers: int, batch: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="nns-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache,
                   TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0",
                   TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.inductor_training", "--child", name,
             "--layers", str(layers), "--batch", str(batch)],
            capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: first steps failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _steady(layers: int, batch: int, rounds: int, steps: int) -> dict[str, float]:
    steppers = {name: _stepper(name, layers, batch) for name in ("ours", "torch.compile()")}
    for step in steppers.values():   # compiles (untimed) and warms up
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    names = list(steppers)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            start = time.thread_time()
            for _ in range(steps):
                steppers[name]()
            times[name].append((time.thread_time() - start) / steps)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 blocks, 3 rounds of 5 steps")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers = args.layers or (2 if args.quick else 12)
    if args.child:
        print(json.dumps(_first_steps(args.child, layers, args.batch)))
        return
    rounds, steps = (3, 5) if args.quick else (5, 20)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {sys.version.split()[0]}, torch {torch.__version__}, 1 thread")
    print(f"{layers}-block GPT, batch {args.batch}, seq 64, train(), AdamW; steady: "
          f"median of {rounds} rounds of {steps} steps, interleaved")
    first = {name: _fresh_process(name, layers, args.batch)
             for name in ("ours", "torch.compile()")}
    steady = _steady(layers, args.batch, rounds, steps)
    print(f"{'system':18} {'step 1 cpu s':>12} {'step 1 wall':>11} {'step 2 cpu s':>12} "
          f"{'step 2 wall':>11} {'compile cpu s':>13} {'steady ms':>10}")
    for name in ("ours", "torch.compile()"):
        f, s = first[name], steady[name]
        compile_cpu = f["step1_cpu"] + f["step2_cpu"] - 2 * s
        print(f"{name:18} {f['step1_cpu']:>12.2f} {f['step1_wall']:>11.2f} "
              f"{f['step2_cpu']:>12.2f} {f['step2_wall']:>11.2f} {compile_cpu:>13.2f} "
              f"{s * 1e3:>10.2f}")
    print(f"steady step, ours / torch.compile(): x{steady['ours'] / steady['torch.compile()']:.2f}")


if __name__ == "__main__":
    main()
