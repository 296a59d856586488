"""Data-dependent control flow, steady state: eager, ours and Dynamo side by side.

    .venv/bin/python -m benchmarks.control_flow [--quick] [--repeats N] [--min-time S]

Every forward of benchmarks/control_flow_models.py's SUITE (`if` on a tensor becomes
torch.cond, `while` on a tensor a while_loop, in our capture) runs on the inputs that
take each of its sides (the predicates flip from one call to the next), inference
(no_grad), one thread, in three systems, each with its own copy of the same weights:
- eager PyTorch;
- ours: `nnscaler.compile(m)` (one graph per forward, the eager runner);
- Dynamo: `torch.compile(m, backend="eager")`, which graph-breaks at each such test.
Before timing, each system makes two passes over the inputs (captures, compiles) and
its outputs are checked against eager's.  Then a loop count is calibrated so that one
timed loop (that many passes over the inputs) lasts at least `--min-time`, and each of
`--repeats` repeats times every system once, the order rotated by one per repeat;
the garbage collector is off while a loop runs.  Reported: the median time per call
with p10/p90, ratios of medians against eager and against Dynamo from the same run,
our captures and fallbacks, Dynamo's graph count; the geometric mean of the ratios over
the suite.  Written to benchmarks/results/<date>-control_flow.{md,json} (with -quick).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import nnscaler
from benchmarks import control_flow_models as models

SYSTEMS = ("eager", "ours", "dynamo")


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(_close, a, b))
    return bool(a == b)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, check=False).stdout.strip())
    except OSError:
        commit, dirty = "", False
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "python": sys.version.split()[0], "torch": torch.__version__,
            "commit": commit + (" (dirty)" if dirty else ""), "load": os.getloadavg()[0]}


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _timed(model: Any, inputs: list[tuple[Any, ...]], passes: int) -> float:
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(passes):
            for args in inputs:
                model(*args)
        return time.perf_counter() - start
    finally:
        gc.enable()


def run_case(name: str, factory: Callable[[], Any], make_inputs: Callable[[], list],
             repeats: int, min_time: float) -> dict[str, Any]:
    torch.manual_seed(0)
    base = factory().eval()
    inputs = make_inputs()
    torch._dynamo.reset()
    graphs_before = _dynamo_graphs()
    systems = {"eager": copy.deepcopy(base), "ours": nnscaler.compile(copy.deepcopy(base)),
               "dynamo": torch.compile(copy.deepcopy(base), backend="eager")}
    equal = {}
    for label, model in systems.items():
        for _ in range(2):
            outs = [model(*args) for args in inputs]
        equal[label] = all(_close(systems["eager"](*args), out)
                           for args, out in zip(inputs, outs))
    dynamo_graphs = _dynamo_graphs() - graphs_before
    info = nnscaler.cache_info(systems["ours"])
    passes = 1
    while _timed(systems["eager"], inputs, passes) < min_time and passes < 1 << 20:
        passes *= 2
    samples: dict[str, list[float]] = {label: [] for label in systems}
    labels = list(systems)
    for r in range(repeats):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            seconds = _timed(systems[label], inputs, passes)
            samples[label].append(seconds / (passes * len(inputs)))
    result: dict[str, Any] = {"case": name, "calls_per_loop": passes * len(inputs),
                              "equal_to_eager": equal, "captures": info.captures,
                              "fallbacks": info.fallbacks, "dynamo_graphs": dynamo_graphs,
                              "samples": samples}
    result["median"] = {k: statistics.median(v) for k, v in samples.items()}
    result["p10"] = {k: _percentile(v, 0.1) for k, v in samples.items()}
    result["p90"] = {k: _percentile(v, 0.9) for k, v in samples.items()}
    return result


def report(results: list[dict[str, Any]], machine: dict[str, Any], args: Any) -> str:
    lines = [f"# Control flow on tensors, steady state ({datetime.date.today()})", "",
             f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['threads']} "
             f"torch thread(s); Python {machine['python']}, torch {machine['torch']}; "
             f"commit {machine['commit']}; load average {machine['load']:.2f} at start, "
             f"{os.getloadavg()[0]:.2f} at end.", "",
             f"no_grad, {args.repeats} interleaved repeats (rotated order), each loop >= "
             f"{args.min_time * 1e3:.0f} ms; times are per call, median [p10-p90] in µs; "
             "ratios are medians of the same run.", "",
             "| forward | eager µs | ours µs | Dynamo-eager µs | ours / eager | "
             "ours / Dynamo | our graphs (fallbacks) | Dynamo graphs | equal to eager |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(r: dict[str, Any], k: str) -> str:
        return (f"{r['median'][k] * 1e6:.1f} [{r['p10'][k] * 1e6:.1f}-"
                f"{r['p90'][k] * 1e6:.1f}]")

    for r in results:
        m = r["median"]
        equal = "yes" if all(r["equal_to_eager"].values()) else \
            "NO: " + ", ".join(k for k, v in r["equal_to_eager"].items() if not v)
        lines.append(f"| {r['case']} | {cell(r, 'eager')} | {cell(r, 'ours')} | "
                     f"{cell(r, 'dynamo')} | {m['ours'] / m['eager']:.2f} | "
                     f"{m['ours'] / m['dynamo']:.2f} | {r['captures']} ({r['fallbacks']}) | "
                     f"{r['dynamo_graphs']} | {equal} |")
    geo = {k: math.exp(statistics.fmean(math.log(r["median"]["ours"] / r["median"][k])
                                        for r in results)) for k in ("eager", "dynamo")}
    lines += ["", f"Geometric mean over {len(results)} forwards: ours / eager "
              f"{geo['eager']:.2f}, ours / Dynamo-eager {geo['dynamo']:.2f}.", "",
              "Dynamo graphs: graphs Dynamo compiled for the forward over the warm-up "
              "passes (torch._dynamo's unique_graphs counter); 0 means it compiled none "
              "and ran the frame as eager."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats, 20 ms loops")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--min-time", type=float, default=None, help="seconds per loop")
    parser.add_argument("--only", action="append", default=[], help="a SUITE name")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    args.repeats = args.repeats or (5 if args.quick else 9)
    args.min_time = args.min_time or (0.02 if args.quick else 0.1)
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.cache_size_limit = 64
    machine = _machine()
    results = []
    with torch.no_grad():
        for name, (factory, inputs) in sorted(models.SUITE.items()):
            if args.only and name not in args.only:
                continue
            results.append(run_case(name, factory, inputs, args.repeats, args.min_time))
            r = results[-1]["median"]
            print(f"{name:24} eager {r['eager'] * 1e6:8.1f} µs  ours {r['ours'] * 1e6:8.1f} µs"
                  f"  dynamo {r['dynamo'] * 1e6:8.1f} µs", flush=True)
    text = report(results, machine, args)
    print(text)
    stem = f"{datetime.date.today()}{'-quick' if args.quick else ''}-control_flow"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(
        {"machine": machine, "settings": vars(args), "results": results}, indent=1))
    print(f"written: {out / stem}.md, .json")


if __name__ == "__main__":
    main()
