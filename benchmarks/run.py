"""Run the benchmark suite: `python -m benchmarks.run [--quick] [--only NAME ...]`.

Writes benchmarks/results/<date>.json, <date>.md, <date>-*.png and latest.md.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from typing import Any, Optional

CASES = ["hook_tax", "per_call", "guard_check", "lookup", "capture_time", "recaptures",
         "steady_state", "memory", "regions"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def machine_info() -> dict[str, Any]:
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
        # results files are tracked: a run before this one must not mark the tree dirty
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".",
                               ":(exclude)benchmarks/results")),
        "memory_gib": _mem_total_gib(),
        "loadavg_start": _loadavg(),
    }
    try:
        import nnscaler  # noqa: F401
        from nnscaler_eval import _C  # noqa: F401
        info["nnscaler"] = "importable"
    except Exception as exc:
        info["nnscaler"] = f"import failed: {exc}"
    return info


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except Exception:
        return None


def _mem_total_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _loadavg() -> Optional[list[float]]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes, shorter loops, no Inductor (under 3 minutes)")
    parser.add_argument("--only", action="append", choices=CASES, metavar="NAME",
                        help=f"run only this case (repeatable): {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved repeats per figure (default 7)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: see benchmarks/README.md)")
    parser.add_argument("--clock", choices=["thread", "wall"], default="thread",
                        help="what timed loops measure (default: the thread's CPU time)")
    parser.add_argument("--min-time", type=float, default=None,
                        help="seconds each timed loop lasts at least (default 0.05, quick 0.01)")
    parser.add_argument("--out", default=RESULTS, help="results folder")
    parser.add_argument("--tag", default=None,
                        help="file name stem instead of the date (e.g. for test runs)")
    parser.add_argument("--no-charts", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from benchmarks.harness import Settings, set_clock
    from benchmarks.variants import configure_dynamo

    settings = Settings.create(args.quick, args.repeats, args.threads, args.clock)
    if args.min_time is not None:
        settings.min_time = args.min_time
    saved = (torch.get_num_threads(), dynamo_limits())
    torch.set_num_threads(settings.threads)
    configure_dynamo()
    set_clock(settings.clock)
    try:
        return _run(args, settings)
    finally:   # leave the process as it was (the smoke test runs in pytest's process)
        torch.set_num_threads(saved[0])
        restore_dynamo_limits(saved[1])


def dynamo_limits() -> tuple[int, int]:
    import torch._dynamo

    c = torch._dynamo.config
    return c.recompile_limit, c.accumulated_recompile_limit


def restore_dynamo_limits(limits: tuple[int, int]) -> None:
    import torch._dynamo

    torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit = limits


def _run(args: argparse.Namespace, settings: Any) -> int:
    import torch

    from benchmarks import report
    from benchmarks.harness import Row, error_text
    from benchmarks.variants import DYNAMO_CONFIG_NOTE, reset_all

    torch.manual_seed(0)
    started = time.time()
    meta = machine_info()
    meta.update({
        "date": datetime.date.today().isoformat(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "settings": vars(settings),
        "dynamo_config": DYNAMO_CONFIG_NOTE,
        "options": vars(args),
    })
    print(f"benchmarks ({meta['mode']}): {meta['cpu_model']}, {meta['cores']} cores, "
          f"torch {meta['torch']} ({meta['torch_num_threads']} threads), "
          f"Python {meta['python']}, commit {str(meta['git_commit'])[:10]}", flush=True)

    all_rows: list[Row] = []
    case_meta: dict[str, Any] = {}
    for name in args.only or CASES:
        module = importlib.import_module(f"benchmarks.cases.{name}")
        t0 = time.time()
        print(f"== {name}: {module.TITLE}", flush=True)
        try:
            rows = module.run(settings)
            error = None
        except Exception as exc:  # a broken case must not lose the others
            traceback.print_exc()
            rows, error = [], error_text(exc)
        seconds = time.time() - t0
        case_meta[name] = {"title": module.TITLE, "seconds": round(seconds, 1),
                           "error": error, "doc": (module.__doc__ or "").strip()}
        for row in rows:
            print("   " + report.one_line(row), flush=True)
        print(f"   ({seconds:.1f} s)", flush=True)
        all_rows += rows

    from benchmarks.cases._firstcall import close_shared
    close_shared()
    reset_all()
    meta["seconds"] = round(time.time() - started, 1)
    meta["loadavg_end"] = _loadavg()
    stem = args.tag or meta["date"] + ("-quick" if args.quick else "")
    os.makedirs(args.out, exist_ok=True)
    data = {"meta": meta, "cases": case_meta, "rows": [r.as_dict() for r in all_rows]}
    json_path = os.path.join(args.out, f"{stem}.json")
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    charts = [] if args.no_charts else report.charts(data, args.out, stem)
    md_path = os.path.join(args.out, f"{stem}.md")
    with open(md_path, "w") as f:
        f.write(report.markdown(data, charts))
    if args.tag is None:
        report.write_latest(args.out, stem)
    print(f"wrote {json_path}, {md_path}, {len(charts)} chart(s) "
          f"in {meta['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
