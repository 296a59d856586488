"""Cold and warm start with Inductor: compile and first call in a fresh process, side by side.

    .venv/bin/python -m benchmarks.cold_start [--quick] [--layers N] [--rounds R] [--warm W]
                                              [--modes eval,train] [--no-write]

The GPT of benchmarks/models.py (d=128, 4 heads, sequence 64; 12 blocks, 2 with
`--quick`), as a new user would compile it:
- ours: `nnscaler.compile(m, backend="inductor")` (block reuse on, the default: the
  repeated TransformerBlock is one subgraph, compiled once);
- ours (no block reuse), `block_reuse=False`: the whole graph inlined, as before;
- `torch.compile(m)` (Inductor, its defaults);
- torch.compile (regional): `torch.compiler.nested_compile_region` on
  `TransformerBlock.forward`, then `torch.compile(m)`: Dynamo's own way to compile a
  repeated block once.
`--systems` picks some of them (comma-separated, by the names in SYSTEMS).
Modes: `eval` (batch 1, `eval()`, one forward under no_grad) and `train` (batch 8,
`train()`, forward, `backward()` and an AdamW step; the optimizer is not compiled).

Each figure is what a user waits for in a fresh Python process after building the
model: `torch.compile(m)` (which imports Dynamo and Inductor) or `import nnscaler`
and `nnscaler.compile(m, ...)`, then the first call (the first step in `train`);
importing torch and building the model are before it and not counted (`process s`
adds them).  Wall seconds, and CPU seconds of the process and of every process it
started (the C++ compiler, Inductor's compile workers), which a loaded machine
inflates less.  A process starts with an empty `TORCHINDUCTOR_CACHE_DIR` (cold) or
with the folder a cold process of the same system just filled (warm); nothing else is
set, Inductor's defaults stand.  Each round runs, per mode, every system's cold process followed by `--warm` warm ones, the
systems in a rotated order (round r starts at system r); medians over rounds (cold)
and over every warm process (warm), and the ratios ours / torch.compile() of those
medians.  The warm processes also report the caches' counters (`fxgraph_cache_hit`,
`autograd_cache_hit`, bypasses) from `torch._dynamo.utils.counters`.

One thing outside the cache folder is not cold: Inductor keeps the precompiled header
its CPU kernels include (`cpp_prefix.h`, about 4.6 s of g++ to make) in its default
folder (`<tmp>/torchinductor_<user>/precompiled_headers`, keyed by compiler and
flags), whatever `TORCHINDUCTOR_CACHE_DIR` says: only the first process ever on a
machine makes it, for every system alike.

Writes benchmarks/results/cold-start-<date>-<N>-blocks[-quick].{md,json} unless
`--no-write`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

SYSTEMS = ("ours", "ours (no block reuse)", "torch.compile()", "torch.compile (regional)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


# -- the child: one first call in this process -----------------------------------------


def _child(system: str, mode: str, layers: int) -> dict[str, Any]:
    start = time.perf_counter()
    import torch

    from benchmarks import models

    torch.manual_seed(0)
    model = models.GPT(models.GPTConfig(layers=layers, seq=64, dim=128, heads=4))
    gen = torch.Generator().manual_seed(1)
    model.train(mode == "train")
    x = torch.randint(0, 512, (1, 64) if mode == "eval" else (8, 64), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if mode == "train" else None

    # From here: what the user waits for to get the first result.  torch.compile()
    # imports Dynamo and Inductor when it is called; ours, `import nnscaler` and
    # compile(), which import what they need, are counted the same way.
    before, cpu = time.perf_counter(), _tree_cpu()
    if system.startswith("ours"):
        import nnscaler

        compiled = nnscaler.compile(model, backend="inductor",
                                    block_reuse=system == "ours")
    else:
        if system == "torch.compile (regional)":
            models.TransformerBlock.forward = torch.compiler.nested_compile_region(
                models.TransformerBlock.forward)
        compiled = torch.compile(model)
    if opt is None:
        with torch.no_grad():
            compiled(x)
    else:
        compiled(x).float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    after, cpu = time.perf_counter(), _tree_cpu() - cpu
    from torch._dynamo.utils import counters

    caches = {name: n for group in ("aot_autograd", "inductor")
              for name, n in counters[group].items() if "cache" in name}
    return {"first_result_s": after - before, "first_result_cpu_s": cpu,
            "process_s": after - start, "caches": caches}


def _tree_cpu() -> float:
    """CPU seconds of this process, of its finished children (the C++ compiler) and of
    its live descendants (Inductor's compile workers live until the process ends)."""
    import resource

    total = time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total += children.ru_utime + children.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the command: state ppid ... utime(14) stime(15) cutime(16) cstime(17)
        kids.setdefault(int(fields[1]), []).append(int(name))
        cpu[int(name)] = sum(int(v) for v in fields[11:15]) / tick
    pending = list(kids.get(os.getpid(), ()))
    while pending:
        pid = pending.pop()
        total += cpu.get(pid, 0.0)
        pending += kids.get(pid, ())
    return total


def _fresh_process(system: str, mode: str, layers: int, cache_dir: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    for name in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cold_start", "--child", system, "--mode", mode,
         "--layers", str(layers)],
        capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} {mode}: the child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the parent: rounds, medians, the report ---------------------------------------------


def _run(layers: int, modes: list[str], rounds: int, warm: int,
         systems: tuple[str, ...] = SYSTEMS) -> dict[str, Any]:
    samples: dict[str, dict[str, dict[str, list[dict]]]] = {
        mode: {s: {"cold": [], "warm": []} for s in systems} for mode in modes}
    for r in range(rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for mode in modes:
            for system in order:
                with tempfile.TemporaryDirectory(prefix="nns-cold-start-") as cache_dir:
                    cold = _fresh_process(system, mode, layers, cache_dir)
                    samples[mode][system]["cold"].append(cold)
                    print(f"round {r + 1} {mode:5} {system:16} cold "
                          f"{cold['first_result_s']:8.2f} s ({cold['first_result_cpu_s']:.2f} CPU s)",
                          flush=True)
                    for _ in range(warm):
                        again = _fresh_process(system, mode, layers, cache_dir)
                        samples[mode][system]["warm"].append(again)
                        print(f"round {r + 1} {mode:5} {system:16} warm "
                              f"{again['first_result_s']:8.2f} s "
                              f"({again['first_result_cpu_s']:.2f} CPU s) {again['caches']}",
                              flush=True)
    return samples


def _median(runs: list[dict], field: str = "first_result_s") -> float:
    return statistics.median(run[field] for run in runs) if runs else float("nan")


def _report(meta: dict[str, Any], samples: dict[str, Any]) -> str:
    machine = meta["machine"]
    lines = [f"# Cold and warm start with Inductor ({meta['date']})", "",
             f"`{meta['command']}`", "",
             f"Machine: {machine['cpu_model']}, {machine['cores']} cores, "
             f"Python {machine['python']}, torch {machine['torch']}, "
             f"commit {(machine['git_commit'] or '?')[:7]}"
             f"{' (dirty)' if machine['git_dirty'] else ''}; load average "
             f"{machine['loadavg_start']} at start, {meta['loadavg_end']} at end.", "",
             f"{meta['layers']}-block GPT (d=128, 4 heads, sequence 64); eval: batch 1, "
             "no_grad, one forward; train: batch 8, forward + backward + AdamW step.  "
             "`compile()` and the first call in a fresh process (ours: with `import "
             "nnscaler`; torch.compile() imports Dynamo and Inductor when called), "
             "Inductor's defaults: wall seconds, and CPU seconds of the process and "
             "every process it started (the C++ compiler, Inductor's compile workers); "
             "importing torch and building the model are not counted (`process` wall s "
             f"includes them).  Median of {meta['rounds']} "
             f"cold process(es) and of {meta['rounds'] * meta['warm']} warm ones per "
             "system and mode.", "",
             "| mode | system | cold wall s | cold CPU s | warm wall s | warm CPU s "
             "| warm process wall s |",
             "|---|---|---|---|---|---|---|"]
    for mode, per_system in samples.items():
        for system in per_system:
            runs = per_system[system]
            lines.append(
                f"| {mode} | {system} | {_median(runs['cold']):.2f} | "
                f"{_median(runs['cold'], 'first_result_cpu_s'):.2f} | "
                f"{_median(runs['warm']):.2f} | {_median(runs['warm'], 'first_result_cpu_s'):.2f} "
                f"| {_median(runs['warm'], 'process_s'):.2f} |")
    lines += ["", "Each system / torch.compile(), ratios of the medians:", "",
              "| mode | system | cold wall | cold CPU | warm wall | warm CPU |",
              "|---|---|---|---|---|---|"]
    for mode, per_system in samples.items():
        theirs = per_system.get("torch.compile()")
        for system, ours in per_system.items():
            if theirs is None or system == "torch.compile()":
                continue

            def ratio(kind: str, field: str) -> str:
                return f"x{_median(ours[kind], field) / _median(theirs[kind], field):.2f}"

            lines.append(f"| {mode} | {system} | {ratio('cold', 'first_result_s')} | "
                         f"{ratio('cold', 'first_result_cpu_s')} | "
                         f"{ratio('warm', 'first_result_s')} | "
                         f"{ratio('warm', 'first_result_cpu_s')} |")
    lines += ["", "Caches in the warm processes (`torch._dynamo.utils.counters`, the first "
              "warm process of each):", ""]
    for mode, per_system in samples.items():
        for system in per_system:
            if per_system[system]["warm"]:
                lines.append(f"- {mode}, {system}: {per_system[system]['warm'][0]['caches']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 blocks, 1 round, 2 warm")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="cold processes per system")
    parser.add_argument("--warm", type=int, default=None, help="warm processes per cold one")
    parser.add_argument("--modes", default="eval,train")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated, of: " + ", ".join(SYSTEMS))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="eval", help=argparse.SUPPRESS)
    args = parser.parse_args()
    layers = args.layers or (2 if args.quick else 12)
    if args.child:
        print(json.dumps(_child(args.child, args.mode, layers)))
        return
    from benchmarks.run import _loadavg, machine_info

    rounds = args.rounds or 1
    warm = args.warm if args.warm is not None else (2 if args.quick else 3)
    modes = [m for m in args.modes.split(",") if m]
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        parser.error(f"--systems: unknown {unknown}; known: {', '.join(SYSTEMS)}")
    meta: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "layers": layers, "rounds": rounds,
        "warm": warm, "modes": modes, "systems": systems, "machine": machine_info(),
        "command": "python -m benchmarks.cold_start " + " ".join(sys.argv[1:]),
    }
    print(f"machine: {meta['machine']['cpu_model']}, {meta['machine']['cores']} cores, "
          f"Python {meta['machine']['python']}, torch {meta['machine']['torch']}", flush=True)
    samples = _run(layers, modes, rounds, warm, systems)
    meta["loadavg_end"] = _loadavg()
    report = _report(meta, samples)
    print(report)
    if not args.no_write:
        stem = (f"cold-start-{meta['date']}-{layers}-blocks"
                f"{'-quick' if args.quick else ''}")
        with open(os.path.join(RESULTS, stem + ".json"), "w") as f:
            json.dump({"meta": meta, "samples": samples}, f, indent=1)
        with open(os.path.join(RESULTS, stem + ".md"), "w") as f:
            f.write(report)
        print(f"wrote benchmarks/results/{stem}.{{md,json}}")


if __name__ == "__main__":
    main()
