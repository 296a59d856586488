"""Subprocess for the hook-tax case, "without the package": torch is imported (as in
every other variant) but nnscaler is not.  Protocol on stdin/stdout, one line each:
`<workload>\t<iterations>\t<clock>` -> seconds per iteration (the garbage collector off while
timing); `quit` ends it."""
from __future__ import annotations

import gc
import sys
import time

import torch  # noqa: F401  (the other variants have it imported too)

from benchmarks.pyworkloads import WORKLOADS


def main() -> None:
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


if __name__ == "__main__":
    main()
