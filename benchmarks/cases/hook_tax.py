"""1. Hook tax: what pure-Python code that is never captured pays for the package.

fib(20) (21,892 frames per call) and a nested-call workload (1,401 frames: functions,
a constructor and a method).  Variants, each pair compared measuring the same loop:
- none: a subprocess with torch imported and nnscaler *not* imported (baseline);
- imported: a subprocess with nnscaler imported and a compiled model alive, code run
  outside any compiled call (the hook should not even be installed);
- dynamo alive: a subprocess with a torch.compile'd model alive (nnscaler not
  imported), code run outside it: the peer of "imported";
- armed (rewrite): in this process, inside `nnscaler.eval_frame.enable()`: every
  frame goes through our C shim, which finds no target and defers to CPython;
- armed (capture): inside `nnscaler.eval_frame.enable(backend="eager")`, same frames;
- dynamo run-only: inside `torch._dynamo.run()` (Dynamo's callback installed, no
  compilation), Dynamo's nearest equivalent of an armed region: the peer of "armed".
The three subprocesses run the same worker (benchmarks/hook_tax_worker.py), each
holding only what its variant names.  Unit: ns per Python frame; ratio to "none".
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Any, Optional

import torch

from benchmarks.harness import Loop, NotAvailable, Row, Settings, Variant, measure
from benchmarks.pyworkloads import WORKLOADS
from benchmarks.variants import nnscaler_module

NAME = "hook_tax"
TITLE = "Hook tax on pure-Python code (ns per frame)"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Worker:
    """One subprocess of benchmarks/hook_tax_worker.py, in `mode` ("none", "ours" or
    "dynamo")."""

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.hook_tax_worker", self.mode], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        if ready != "ready":
            self.close()
            raise NotAvailable(f"hook-tax worker ({self.mode}) did not start (got {ready!r})")

    def __init__(self, clock: str, mode: str) -> None:
        self.clock = clock
        self.mode = mode
        self._start()

    def run(self, workload: str, n: int) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{workload}\t{n}\t{self.clock}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("hook-tax worker exited")
        return float(line) * n   # seconds for the n iterations

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.stdin:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()


def _plain_loop(fn: Any) -> Loop:
    def loop(n: int) -> Optional[float]:
        for _ in range(n):
            fn()
        return None
    return loop


def run(settings: Settings) -> list[Row]:
    rows: list[Row] = []
    workers: dict[str, Any] = {}
    for mode in ("none", "ours", "dynamo"):
        try:
            workers[mode] = Worker(settings.clock, mode)
        except Exception as exc:
            workers[mode] = exc

    def armed(backend: Optional[str]) -> Any:
        try:
            nnscaler = nnscaler_module()
            return nnscaler.eval_frame.enable() if backend is None else \
                nnscaler.eval_frame.enable(backend=backend)
        except NotAvailable:
            raise
        except Exception as exc:
            raise NotAvailable(f"eval_frame.enable() failed: {exc}") from exc

    for workload, (fn, frames) in WORKLOADS.items():
        def in_worker(mode: str, workload: str = workload) -> Loop:
            worker = workers[mode]
            if isinstance(worker, Exception):
                raise NotAvailable(f"subprocess ({mode}) failed: {worker}")
            return lambda n: worker.run(workload, n)

        def armed_setup(backend: Optional[str], fn: Any = fn) -> Loop:
            nnscaler_module()
            with armed(backend):
                pass
            return _plain_loop(fn)

        def dynamo_run_only(fn: Any = fn) -> Loop:
            import torch._dynamo
            wrapped = torch._dynamo.run(fn)
            return _plain_loop(wrapped)

        variants = [
            Variant("none", lambda workload=workload: in_worker("none", workload)),
            Variant("imported", lambda workload=workload: in_worker("ours", workload)),
            Variant("dynamo alive", lambda workload=workload: in_worker("dynamo", workload)),
            Variant("armed (rewrite)", lambda fn=fn: armed_setup(None, fn),
                    context=lambda: armed(None)),
            Variant("armed (capture)", lambda fn=fn: armed_setup("eager", fn),
                    context=lambda: armed("eager")),
            Variant("dynamo run-only", dynamo_run_only),
        ]
        rows += measure(NAME, workload, variants, settings, unit="ns", baseline="none",
                        per_iteration=frames, params={"frames_per_call": frames})
    for worker in workers.values():
        if not isinstance(worker, Exception):
            worker.close()
    torch._dynamo.reset()
    return rows
