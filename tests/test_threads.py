"""Threads sharing compiled modules: a capture never shows another thread anything
foreign (no TrainingFlag in a module's `__dict__` or from `module.training`), hooks
added and removed meanwhile always run, and cache_size_limit holds.

The heavy run is a subprocess with a timeout (a deadlock must fail, not hang pytest).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from nnscaler_eval import _C
from nnscaler_eval.tracing import trace_patches

CHILD_FLAG = "--threads-child"
THREADS = 8
CALLS_PER_THREAD = int(os.environ.get("NNSCALER_THREAD_CALLS", "2500"))
CACHE_LIMIT = 8


class Net(nn.Module):
    """Flags used as values (ifexpr, two Dropouts in opposite modes) and for branching."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.d_on = nn.Dropout(0.5)  # kept in train()
        self.d_off = nn.Dropout(0.5)  # kept in eval()
        self.d_on.train()
        self.d_off.eval()

    def forward(self, x):
        y = self.fc(x)
        scale = 2.0 if self.training else 1.0
        if self.training:
            y = y + 1
        return self.d_on(y) * scale, self.d_off(y)


def expected(net: Net, x: torch.Tensor, training: bool) -> torch.Tensor:
    """y as the forward computes it before the dropouts (plain torch, no module call)."""
    with torch.no_grad():
        y = F.linear(x, net.fc.weight, net.fc.bias)
        return y + 1 if training else y


def check_outputs(net: Net, x: torch.Tensor, training: bool, out) -> str:
    """'' if `out` is what eager could return for this call, else what is wrong."""
    on, off = out
    y = expected(net, x, training)
    scale = 2.0 if training else 1.0
    if not torch.allclose(off, y, rtol=1e-5, atol=1e-6):
        return f"d_off (eval) changed its input (training={training})"
    kept = torch.isclose(on, y * 2 * scale, rtol=1e-5, atol=1e-6)
    dropped = on == 0
    if not bool((kept | dropped).all()):
        return f"d_on output is not dropout of y (training={training})"
    if on.numel() >= 32 and not bool(dropped.any()):
        return "d_on (train) dropped nothing"
    return ""


def assert_no_flags(*modules: nn.Module) -> None:
    for module in modules:
        for m in module.modules():
            assert type(m.__dict__["training"]) is bool, m
            assert type(m.training) is bool, m


# ---------------------------------------------------------------------------
# Deterministic: eager use of the very modules a compiled call is capturing


def test_eager_calls_of_the_same_modules_during_a_capture_see_bools():
    inside = threading.Event()
    release = threading.Event()

    class Slow(Net):
        def forward(self, x):
            y = self.fc(x)
            inside.set()
            assert release.wait(30)
            return self.d_on(y), self.d_off(y)

    net = Slow()
    compiled = nnscaler.compile(net)
    x = torch.randn(4, 8)
    results: dict = {}

    def capture() -> None:
        try:
            results["out"] = compiled(x)
        except BaseException as exc:  # surfaced below
            results["error"] = exc

    thread = threading.Thread(target=capture)
    thread.start()
    try:
        assert inside.wait(30)
        # The other thread is inside the trace of `net` now.
        assert trace_patches.active_traces() == 1
        assert "training" in nn.Module.__dict__  # the descriptor is in
        assert_no_flags(net)
        # The very same submodules, called eagerly here: no TrainingFlag reaches
        # dropout's bool parameter (it raised TypeError when flags lived in __dict__).
        y = net.fc(x)
        assert torch.equal(net.d_off(y), y)
        dropped = net.d_on(torch.ones(64))
        assert bool(((dropped == 0) | (dropped == 2)).all()) and bool((dropped == 0).any())
        assert torch.equal(F.dropout(y, 0.5, net.d_off.training), y)
        # Writes from this thread are plain writes, not state writes of the trace.
        net.d_off.train(False)
        object.__setattr__(net.d_off, "training", False)
    finally:
        release.set()
        thread.join(30)
    assert not thread.is_alive()
    assert "error" not in results, results.get("error")
    assert "training" not in nn.Module.__dict__
    assert_no_flags(net)
    assert nnscaler.cache_info(net).captures == 1
    # The capture recorded the flags as graph inputs, and later calls hit with the
    # modes of the call.
    on, off = compiled(x)
    assert torch.equal(off, net.fc(x))
    net.d_on.eval()
    on, off = compiled(x)
    assert torch.equal(on, net.fc(x))
    assert nnscaler.cache_info(net).captures == 1


def test_a_thread_missing_while_another_captures_runs_eagerly_and_correctly():
    inside = threading.Event()
    release = threading.Event()

    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.wait = True

        def forward(self, x):
            if self.wait and x.shape[0] == 1:
                inside.set()
                assert release.wait(30)
            return self.fc(x) * 2

    net = nnscaler.compile(Gate())
    errors: list = []

    def first() -> None:
        try:
            net(torch.ones(1, 4))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert inside.wait(30)
        x = torch.randn(3, 4)
        # No waiting on the capture lock (a wait could deadlock): eager, uncached.
        assert torch.equal(net(x), net.fc(x) * 2)
        assert nnscaler.cache_info(net).captures == 0
    finally:
        release.set()
        thread.join(30)
    assert not errors
    assert nnscaler.cache_info(net).captures == 1
    net.wait = False
    x = torch.randn(3, 4)
    assert torch.equal(net(x), net.fc(x) * 2)
    assert nnscaler.cache_info(net).captures == 2


def test_a_hook_registered_between_the_trace_and_its_entry_is_not_missed():
    """Another thread may register a hook after the trace saw a module but before the
    C entry snapshots the hook dicts' versions: that entry must not be cached. The
    backend runs in exactly that window, so it stands in for the other thread here."""
    net = Net().eval()
    net.d_on.eval()
    ran: list[int] = []
    handles: list = []

    def backend(gm, example_inputs):
        if not handles:
            handles.append(net.fc.register_forward_hook(lambda *args: ran.append(1)))
        return gm

    compiled = nnscaler.compile(net, backend=backend)
    x = torch.randn(4, 8)
    compiled(x)  # traced before the hook existed: its result stands
    assert ran == []
    out = compiled(x)  # must run the hook (the first entry was dropped)
    assert ran == [1]
    assert torch.allclose(out[1], net.fc(x))
    assert ran == [1, 1]
    compiled(x)
    assert len(ran) == 3
    handles[0].remove()


def test_cache_limit_counts_entries_still_on_their_way_to_c():
    """C inserts an entry after convert_frame returned, outside the capture lock; a
    capture on another thread in between must count it (here: a reply not yet
    consumed, as C holds it meanwhile)."""
    from nnscaler_eval.shared_objects import RUN_DISARMED
    from nnscaler_eval.config import CompileConfig
    from nnscaler_eval.convert_frame import convert_frame

    class Bucket:  # what convert_frame reads of C's bucket
        def __init__(self, n: int) -> None:
            self.entries = [object() for _ in range(n)]
            self.limit_warned = 1  # the limit warning is not what this test is about

        def take_dropped(self) -> list:
            return []

    limit = 3
    config = CompileConfig.create(cache_size_limit=limit)
    net = Net().eval()
    forward = type(net).forward
    bucket = Bucket(limit - 1)

    def miss(n: int):
        x = torch.randn(n, 8)
        return convert_frame(config, forward, forward.__code__, net, (net, x), bucket,
                             _C.CallKey(x))

    first = miss(1)
    assert first[1] is not None  # an entry, not inserted yet
    second = miss(2)  # limit - 1 inserted + 1 in flight: the limit is reached
    assert second[0] is RUN_DISARMED and second[1] is None
    del first  # C dropped the reply without inserting
    third = miss(3)
    assert third[1] is not None
    del third


# ---------------------------------------------------------------------------
# Heavy: 8 threads, one shared compiled model, hooks churning, shapes past the limit


def _run_threads(net: Net, calls_per_thread: int, churn_hooks: bool) -> dict:
    """THREADS workers calling the compiled `net` through phases of train / eval (the
    root only), 12 shapes; with `churn_hooks`, each worker keeps a hook of its own on
    the shared `net.fc` for 20 calls of every 50.  Two more threads call the same
    modules eagerly throughout, and a monitor watches the cache's size."""
    import time

    from nnscaler_eval.tools import explain

    phases = 4  # root train / eval / train / eval; d_on and d_off keep their modes
    per_phase = calls_per_thread // phases
    barrier = threading.Barrier(THREADS, timeout=300)
    errors: list[str] = []
    stop = threading.Event()
    stats = {"calls": 0, "eager_calls": 0, "eager_during_capture": 0, "max_entries": 0,
             "hook_windows": 0}
    lock = threading.Lock()

    def record_error(message: str) -> None:
        with lock:
            if len(errors) < 20:
                errors.append(message)
        stop.set()
        barrier.abort()

    def worker(k: int) -> None:
        me = threading.get_ident()
        seen = [0]

        def hook(module, args, output):
            if threading.get_ident() == me:
                seen[0] += 1

        calls = 0
        try:
            for phase in range(phases):
                if k == 0:
                    net.training = phase % 2 == 0  # the root only
                barrier.wait()
                training = phase % 2 == 0
                handle = None
                for i in range(per_phase):
                    if stop.is_set():
                        return
                    # A hook of this thread on a shared submodule for 20 calls of
                    # every 50: every call of this thread inside the window runs it.
                    if churn_hooks and i % 50 == 0:
                        handle = net.fc.register_forward_hook(hook)
                        seen[0] = 0
                    n = 1 + (i * 7 + k) % 12  # 12 shapes, x 2 modes
                    x = torch.randn(n, 8)
                    out = net(x)
                    problem = check_outputs(net, x, training, out)
                    if problem:
                        record_error(f"thread {k} call {i} phase {phase}: {problem}")
                        return
                    calls += 1
                    if churn_hooks and i % 50 == 19:
                        handle.remove()
                        handle = None
                        if seen[0] != 20:
                            record_error(f"thread {k}: its hook ran {seen[0]} times in 20 calls")
                            return
                        with lock:
                            stats["hook_windows"] += 1
                if handle is not None:
                    handle.remove()
                barrier.wait()
        except threading.BrokenBarrierError:
            if not errors:
                record_error(f"thread {k}: barrier broken")
        except BaseException as exc:
            record_error(f"thread {k}: {type(exc).__name__}: {exc}")
            barrier.abort()
        finally:
            with lock:
                stats["calls"] += calls

    def eager_user() -> None:
        # The same modules, called eagerly (never through the compiled root).
        try:
            while not stop.is_set():
                during = trace_patches.active_traces() > 0
                for m in (net, net.fc, net.d_on, net.d_off):
                    if type(m.training) is not bool or type(m.__dict__["training"]) is not bool:
                        record_error(f"eager thread saw {type(m.training).__name__} in "
                                     f"{type(m).__name__}.training")
                        return
                x = torch.randn(4, 8)
                y = net.fc(x)
                if not torch.equal(net.d_off(y), y):
                    record_error("eager d_off (eval) changed its input")
                    return
                z = net.d_on(torch.ones(64))
                if not bool(((z == 0) | (z == 2)).all()):
                    record_error("eager d_on (train) is not a dropout")
                    return
                with lock:
                    stats["eager_calls"] += 1
                    stats["eager_during_capture"] += during
        except BaseException as exc:
            record_error(f"eager thread: {type(exc).__name__}: {exc}")

    def monitor() -> None:
        while not stop.is_set():
            for bucket in explain._buckets(net):
                stats["max_entries"] = max(stats["max_entries"], len(bucket.entries))
            time.sleep(0.0005)

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    helpers = [threading.Thread(target=eager_user) for _ in range(2)]
    helpers.append(threading.Thread(target=monitor))
    start = time.perf_counter()
    for t in workers + helpers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    for t in helpers:
        t.join()
    elapsed = time.perf_counter() - start

    flags_left = [
        f"{type(m).__name__}" for m in net.modules()
        if type(m.__dict__["training"]) is not bool
    ]
    buckets = list(explain._buckets(net))
    info = nnscaler.cache_info(net)
    # Afterwards, single-threaded: results equal eager (deterministic modes).
    net.eval()
    net.d_on.eval()
    after = []
    for n in range(1, 13):
        x = torch.randn(n, 8)
        on, off = net(x)
        y = net.fc(x)
        after.append(bool(torch.allclose(on, y) and torch.allclose(off, y)))
    return {
        "errors": errors,
        "calls": stats["calls"],
        "expected_calls": THREADS * phases * per_phase,
        "eager_calls": stats["eager_calls"],
        "eager_during_capture": stats["eager_during_capture"],
        "hook_windows": stats["hook_windows"],
        "max_entries": max([stats["max_entries"]] + [len(b.entries) for b in buckets]),
        "buckets": len(buckets),
        "captures": info.captures,
        "hits": info.hits,
        "fallbacks": info.fallbacks,
        "flags_left": flags_left,
        "descriptor_left": "training" in nn.Module.__dict__,
        "patched": trace_patches.patched(),
        "after_equal_eager": all(after),
        "seconds": round(elapsed, 1),
    }


def _child(calls_per_thread: int) -> dict:
    """Two runs, each on a model of its own.  With hooks churning, hits are up to the
    scheduler: every register makes a new handle key, so a hook state seldom recurs,
    and when the threads start together their first calls capture one state each, up to
    the limit, then run eagerly for good; what that run proves is that every call is
    right and every hook runs.  Without hooks, the states recur and the calls must hit."""
    torch.manual_seed(0)
    runs = {}
    for name, churn in (("hooks", True), ("quiet", False)):
        net = Net()
        nnscaler.compile(net, cache_size_limit=CACHE_LIMIT)
        runs[name] = _run_threads(net, calls_per_thread, churn)
    return runs


def test_eight_threads_share_one_compiled_model():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, __file__, CHILD_FLAG, str(CALLS_PER_THREAD)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(runs, indent=1))
    for name, report in runs.items():
        assert report["errors"] == [], name
        assert report["calls"] == report["expected_calls"], name
        assert report["max_entries"] <= CACHE_LIMIT, name
        assert report["captures"] > 0, name
        assert report["flags_left"] == [], name
        assert not report["descriptor_left"] and report["patched"] == [], name
        assert report["after_equal_eager"], name
    assert runs["hooks"]["hook_windows"] > 0
    # 12 shapes x 2 modes fit in the limit with dynamic shapes: the shared entries
    # serve the threads' calls (here 79-97% of them on 3.11 and 3.12; the rest ran
    # eagerly while another thread captured)
    assert runs["quiet"]["hits"] > runs["quiet"]["expected_calls"] // 4


if __name__ == "__main__" and sys.argv[1:2] == [CHILD_FLAG]:
    result = _child(int(sys.argv[2]))
    sys.stdout.flush()
    print(json.dumps(result))
