"""Subprocess for the hook-tax case: pure-Python workloads timed in a process that
holds one thing, named by the mode argument, so that each variant measures the same
loop in a process of its own:

- `none`: torch imported (as in every other variant), nnscaler not;
- `ours`: nnscaler imported and a compiled model (`nnscaler.compile`, eager backend)
  alive, called before timing; the loop runs outside any compiled call;
- `dynamo`: a `torch.compile`d model (eager backend) alive, called before timing;
  nnscaler not imported.

Protocol on stdin/stdout, one line each: `<workload>\t<iterations>\t<clock>` ->
seconds per iteration (the garbage collector off while timing); `quit` ends it."""
from __future__ import annotations

import gc
import sys
import time
from typing import Any

import torch  # noqa: F401  (the other variants have it imported too)

from benchmarks.pyworkloads import WORKLOADS

MODES = ("none", "ours", "dynamo")


def _alive(mode: str) -> Any:
    """What the process holds for the length of the loop."""
    if mode == "none":
        return None
    from benchmarks import models
    model, (x,) = models.build("mlp", 2)
    if mode == "ours":
        import nnscaler
        compiled = nnscaler.compile(model, backend="eager")
    else:
        compiled = torch.compile(model, backend="eager")
    compiled(x)
    compiled(x)
    return compiled


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "none"
    if mode not in MODES:
        sys.exit(f"hook_tax_worker: mode {mode!r}, not one of {MODES}")
    alive = _alive(mode)
    if mode != "ours":
        assert "nnscaler" not in sys.modules and "nnscaler_eval" not in sys.modules
    print("ready", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if line == "quit" or not line:
            break
        name, n_text, clock_name = line.split("\t")
        clock = time.thread_time if clock_name == "thread" else time.perf_counter
        fn = WORKLOADS[name][0]
        n = int(n_text)
        gc.disable()
        t0 = clock()
        for _ in range(n):
            fn()
        dt = clock() - t0
        gc.enable()
        print(repr(dt / n), flush=True)
    del alive


if __name__ == "__main__":
    main()
