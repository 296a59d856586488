"""A fork server for first-call measurements (capture time, memory).

`python -m benchmarks.zygote` imports torch, torch._dynamo, Inductor's compile_fx and
nnscaler once, never runs a torch op, and then forks one child per job: each child
is a fresh process as far as compilation goes (no cached graphs, no warm Inductor
caches: it gets an empty TORCHINDUCTOR_CACHE_DIR) without paying Python's and torch's
import time again.  Import costs are therefore *not* part of any first-call figure,
for any variant.  Jobs and results are JSON lines on stdin / stdout.
"""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

PROC_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int:
    try:
        with open(PROC_STATUS) as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else -1
    except OSError:
        return -1


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_job(job: dict) -> dict:
    """Runs in the forked child."""
    import gc
    import tracemalloc

    import torch

    from benchmarks import models
    from benchmarks.variants import (
        OURS, OURS_INDUCTOR, compile_variant, configure_dynamo, dynamo_graph_count,
        nnscaler_module,
    )

    configure_dynamo()
    torch.set_num_threads(int(job.get("threads", 1)))
    variant, name = job["variant"], job["model"]
    train = job.get("mode", "train") == "train"
    track_memory = bool(job.get("memory"))
    # Warm the runtime (thread pool, allocator, MKL) with an unrelated op, so that the
    # first call of every variant, eager included, does not pay for it.
    a = torch.randn(64, 64)
    (a @ a).sum().item()
    model, inputs = models.build(name, job.get("batch", 8))
    model.train(train)
    grad = torch.enable_grad() if train else torch.no_grad()
    result: dict[str, Any] = {}
    with grad:
        t0 = time.perf_counter()
        compiled = compile_variant(model, variant)
        result["compile_call_s"] = time.perf_counter() - t0
        gc.collect()
        rss0 = _status_kib("VmRSS")
        result["peak_reset"] = _reset_peak_rss()
        if track_memory:
            tracemalloc.start()
        graphs0 = dynamo_graph_count()
        t0 = time.perf_counter()
        out = compiled(*inputs)
        result["first_s"] = time.perf_counter() - t0
        if track_memory:
            current, peak = tracemalloc.get_traced_memory()
            result["capture_py_peak_mib"] = peak / 2**20
        result["capture_rss_peak_mib"] = (_status_kib("VmHWM") - rss0) / 1024
        del out
        t0 = time.perf_counter()
        compiled(*inputs)
        result["second_s"] = time.perf_counter() - t0
        gc.collect()
        if track_memory:
            result["retained_py_mib"] = tracemalloc.get_traced_memory()[0] / 2**20
            tracemalloc.reset_peak()
        rss1 = _status_kib("VmRSS")
        result["retained_rss_mib"] = (rss1 - rss0) / 1024
        _reset_peak_rss()
        for _ in range(job.get("steady_calls", 10)):
            compiled(*inputs)
        gc.collect()
        if track_memory:
            current, peak = tracemalloc.get_traced_memory()
            result["steady_py_peak_mib"] = peak / 2**20
            tracemalloc.stop()
        result["steady_rss_peak_mib"] = (_status_kib("VmHWM") - rss1) / 1024
        result["steady_rss_growth_mib"] = (_status_kib("VmRSS") - rss1) / 1024
    result["dynamo_graphs"] = dynamo_graph_count() - graphs0
    if variant in (OURS, OURS_INDUCTOR):
        info = nnscaler_module().cache_info(compiled)
        result["cache_info"] = list(info)
        if info.captures == 0:
            result["error"] = f"NotAvailable: no graph captured ({info})"
    return result


def child(job: dict, write_fd: int) -> None:
    os.setsid()       # its own process group: Inductor's compile workers die with it
    cache_dir = tempfile.mkdtemp(prefix="nnscaler-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        result = run_job(job)
    except BaseException as exc:
        from benchmarks.harness import error_text
        result = {"error": error_text(exc), "traceback": traceback.format_exc()[-2000:]}
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    with os.fdopen(write_fd, "w") as f:
        f.write(json.dumps(result))
    os._exit(0)


def serve() -> None:
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    try:
        import torch._inductor.compile_fx  # noqa: F401
    except Exception:
        pass
    try:
        import nnscaler  # noqa: F401
    except Exception:
        pass
    import benchmarks.models  # noqa: F401
    import benchmarks.variants  # noqa: F401

    import gc
    gc.collect()
    gc.freeze()   # children neither scan nor copy-on-write the imported world
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip() or line.strip() == "quit":
            break
        job = json.loads(line)
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            child(job, write_fd)
        os.close(write_fd)
        timeout = float(job.get("timeout", 600))
        chunks: list[bytes] = []
        deadline = time.monotonic() + timeout
        timed_out = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([read_fd], [], [], left)
            if not ready:
                continue
            data = os.read(read_fd, 65536)
            if not data:
                break
            chunks.append(data)
        os.close(read_fd)
        if timed_out:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        _, status = os.waitpid(pid, 0)
        try:
            os.killpg(pid, signal.SIGKILL)     # leftover workers of that child only
        except OSError:
            pass
        if timed_out:
            result = {"error": f"TimeoutError: job ran past {timeout:.0f} s"}
        else:
            text = b"".join(chunks).decode()
            result = json.loads(text) if text else {
                "error": f"ChildDied: exit status {status}"}
        print(json.dumps(result), flush=True)


class Zygote:
    """Parent-side handle."""

    def __init__(self) -> None:
        import subprocess
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.zygote"], cwd=root,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline().strip()
        if ready != "ready":
            self.close()
            raise RuntimeError(f"zygote did not start (got {ready!r})")

    def run(self, job: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("zygote exited")
        return json.loads(line)

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    serve()
