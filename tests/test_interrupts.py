"""KeyboardInterrupt landing anywhere in a first call (capture) leaves nothing behind.

A signal whose handler raises KeyboardInterrupt (SIGALRM with a handler of the test's,
or SIGINT with Python's default one, sent by another thread) fires after a random
tiny delay during the first call of a freshly compiled module, whose capture is
static or symbolic (`dynamic=True`: the forward runs on fake tensors, where torch's
C++ calls Python back): inside the trace patches' install or
uninstall, the user's forward, the tracer's `finally`, convert_frame, ... Every
interrupt is caught; after each one the process must be as before the call (no patch,
no current tracer, no torch function mode, no TrainingFlag in a module `__dict__`,
capture lock free, every signal handler back, no dispatch mode or fake mode left),
the next call must capture normally and give eager's result, and at the end nothing
of the interrupted traces may still be alive.  The process must never abort: a
signal is delivered where Python can unwind (capture/signals.py).

The run happens in a subprocess (signals, and a broken process must not take pytest
down with it), with a timeout.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest

CHILD_FLAG = "--interrupt-child"
CALLS = 300


def _child(calls: int, seed: int, nested: bool = False, symbolic: bool = False,
           signame: str = "SIGALRM") -> dict:
    import builtins
    import collections
    import gc
    import io
    import random
    import signal
    import threading
    import time
    import contextlib

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import nnscaler
    from nnscaler_eval import _C
    from nnscaler_eval.tracing import trace_patches, trace_state
    from nnscaler_eval.capture import Tracer
    from nnscaler_eval.capture import signals as capture_signals
    from nnscaler_eval.tracing.tracked_values import TrainingFlag

    original_call = nn.Module.__dict__["__call__"]
    original_setattr = nn.Module.__dict__["__setattr__"]
    original_print = builtins.print
    original_breakpointhook = sys.breakpointhook
    assert "training" not in nn.Module.__dict__

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.norm = nn.LayerNorm(16)
            self.drop = nn.Dropout(0.2)

        def forward(self, x):
            y = self.norm(self.fc(x))
            scale = 1.0 if self.training else 0.5
            return x + self.drop(F.gelu(y)) * scale

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            if self.training:
                x = x * 2
            return self.head(x)

    baseline: list[tuple[int, int]] = []

    def problems(model: nn.Module) -> list[str]:
        found = []
        # Called from the same frame every time: the same depth, the same limit
        # (credit given to nested captures' user code all given back).
        depth = (_C.recursion_depth(), sys.getrecursionlimit())
        baseline[:] = baseline or [depth]
        if depth != baseline[0]:
            found.append(f"recursion depth/limit {depth}, before {baseline[0]}")
        if trace_patches.patched():
            found.append(f"patched: {trace_patches.patched()}")
        if trace_patches.active_traces():
            found.append(f"active traces: {trace_patches.active_traces()}")
        if nn.Module.__dict__["__call__"] is not original_call:
            found.append("nn.Module.__call__")
        if nn.Module.__dict__["__setattr__"] is not original_setattr:
            found.append("nn.Module.__setattr__")
        if builtins.print is not original_print:
            found.append("print")
        if sys.breakpointhook is not original_breakpointhook:
            found.append("breakpointhook")
        if "training" in nn.Module.__dict__:
            found.append("nn.Module.training descriptor")
        if trace_state.current_tracer() is not None:
            found.append("current tracer")
        if torch._C._len_torch_function_stack():
            modes = [type(m).__name__ for m in
                     torch.overrides._get_current_function_mode_stack()]
            found.append(f"torch function mode left on the stack: {modes}")
        if trace_state.capture_depth():
            found.append("capture lock held")
        if torch._C._len_torch_dispatch_stack():
            found.append("torch dispatch mode left on the stack")
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            found.append("fake tensor mode left set")
        if signal.getsignal(signum) is not handler[0]:
            found.append(f"{signame} handler is {signal.getsignal(signum)}")
        if capture_signals._pending or capture_signals._owner is not None:
            found.append("a signal deferral left behind")
        if _C.current_config() is not None or _C.armed_threads():
            found.append("thread left armed")
        if not gc.isenabled():
            found.append("garbage collection left paused")
        for m in model.modules():
            if type(m.__dict__.get("training")) is not bool:
                found.append(f"{type(m).__name__}.training is {type(m.__dict__.get('training'))}")
        return found

    rng = random.Random(seed)
    torch.manual_seed(seed)
    x = torch.randn(8, 16)

    # How long a first call takes: the alarms are spread over that span.
    spans = []
    for _ in range(3):
        probe = nnscaler.compile(Model(), dynamic=True if symbolic else None)
        start = time.perf_counter()
        probe(x)
        spans.append(time.perf_counter() - start)
    span = min(spans)
    del probe
    nnscaler.reset()

    landed: collections.Counter = collections.Counter()

    signum = getattr(signal, signame)

    def on_alarm(signum, frame):
        code = frame.f_code if frame is not None else None
        if code is None:
            where = "?"
        elif "nnscaler_eval" in code.co_filename:
            where = f"nnscaler_eval/{os.path.basename(code.co_filename)}:{code.co_name}"
        elif "torch" in code.co_filename:
            where = "torch"
        else:
            where = f"test:{code.co_name}"
        landed[where] += 1
        if signum == signal.SIGINT:
            signal.default_int_handler(signum, frame)
        raise KeyboardInterrupt

    signal.signal(signum, on_alarm)
    handler = [on_alarm]

    def arm(delay: float) -> Any:
        if signum == signal.SIGALRM:
            signal.setitimer(signal.ITIMER_REAL, delay)
            return None
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        return timer

    def disarm(timer: Any) -> None:
        if timer is None:
            signal.setitimer(signal.ITIMER_REAL, 0)
        else:
            timer.cancel()
            timer.join()
    failures = []
    interrupted = 0
    masked: collections.Counter = collections.Counter()
    for i in range(calls):
        model = Model()
        model.train(i % 2 == 0)
        reference = Model()
        reference.load_state_dict(model.state_dict())
        reference.train(model.training)
        nnscaler.compile(model, dynamic=True if symbolic else None)
        if nested:
            # Each block its own capture, nested in the model's (an opaque call: hooks).
            for block, twin in zip(model.blocks, reference.blocks):
                for m in (block, twin):
                    m.register_forward_hook(lambda mod, inputs, out: None)
                nnscaler.compile(block)
        delay = rng.uniform(1e-6, span * 1.2)
        try:
            timer = arm(delay)
            try:
                start = time.perf_counter()
                model(x)
                # A first call that outran its alarm: the span follows the fastest
                # (probes taken while the machine was busy would otherwise leave most
                # later delays longer than the calls, and few calls interrupted).
                span = min(span, time.perf_counter() - start)
            finally:
                disarm(timer)
        except BaseException as exc:
            # The interrupt, or an error torch raised while unwinding from it (its
            # own context managers are not interrupt-safe): never anything else.
            cause = exc
            while cause is not None and not isinstance(cause, KeyboardInterrupt):
                cause = cause.__context__
            if cause is None:
                raise
            interrupted += 1
            if cause is not exc:
                masked[type(exc).__name__] += 1
            cause = None  # its traceback holds the interrupted frames
            # What a reference cycle kept of the interrupted frames runs its
            # finalizers now: they must not change the process either (now and then:
            # a collection costs a tenth of a second; the end collects all).
            if interrupted % 10 == 0:
                gc.collect()
        found = problems(model)
        if found:
            failures.append(f"call {i} (delay {delay * 1e3:.2f} ms): {found}")
            break
        # The next call captures (or hits) normally and gives eager's result.
        torch.manual_seed(i)
        got = model(x)
        torch.manual_seed(i)
        want = reference(x)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            failures.append(f"call {i}: result differs from eager after the interrupt")
            break
        found = problems(model)
        if found:
            failures.append(f"call {i}, second call: {found}")
            break
        del model, reference, got, want
    handler[0] = signal.SIG_DFL if signum == signal.SIGALRM else signal.default_int_handler
    signal.signal(signum, handler[0])

    # Nothing of an interrupted trace is still alive.
    gc.collect()
    tracers = sum(1 for o in gc.get_objects() if isinstance(o, Tracer))
    flags = sum(
        1
        for o in gc.get_objects()
        if isinstance(o, nn.Module) and isinstance(o.__dict__.get("training"), TrainingFlag)
    )
    # A fresh capture works, and print() works.
    fresh = nnscaler.compile(Model().eval())
    eager = Model().eval()
    eager.load_state_dict(fresh.state_dict())
    fresh_ok = torch.allclose(fresh(x), eager(x)) and torch.allclose(fresh(x), eager(x))
    captures = nnscaler.cache_info(fresh).captures
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print("still printing")
    return {
        "failures": failures,
        "interrupted": interrupted,
        "landed": dict(landed),
        "masked": dict(masked),
        "tracers_alive": tracers,
        "flags_in_dicts": flags,
        "fresh_ok": bool(fresh_ok),
        "fresh_captures": captures,
        "printed": out.getvalue(),
        "span_ms": span * 1e3,
        "final_problems": problems(fresh),
    }


@pytest.mark.parametrize("kind, signame", [("flat", "SIGALRM"), ("nested", "SIGALRM"),
                                           ("symbolic", "SIGALRM"), ("flat", "SIGINT"),
                                           ("symbolic", "SIGINT")])
def test_interrupts_anywhere_in_first_calls_leave_nothing_behind(kind, signame):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, __file__, CHILD_FLAG, str(CALLS), "1234", kind, signame],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))  # shown with -s: where the interrupts landed
    assert report["failures"] == []
    assert report["final_problems"] == []
    # The alarms really interrupted calls (most delays are shorter than a first call).
    assert report["interrupted"] >= CALLS // 4, report
    assert any(k.startswith("nnscaler_eval/") for k in report["landed"]), report
    assert report["tracers_alive"] == 0
    assert report["flags_in_dicts"] == 0
    assert report["fresh_ok"] and report["fresh_captures"] == 1
    assert report["printed"] == "still printing\n"


# -- an interrupt inside a context manager's own __enter__, placed deterministically --
#
# A signal can land in contextlib's `__enter__` after the generator ran to its `yield`:
# torch's `unset_fake_temporarily` has unset the fake mode, and only that finished
# frame, kept by the traceback, holds the generator.  Its `finally` sets the capture's
# fake mode back whenever the frame is freed (in a reference cycle: at some later GC),
# and every eager call after computes on fake tensors.  Torch code that fails while
# unwinding from the interrupt raises its own error instead (the interrupt in its
# __context__), which the capture must not take for an op refusing symbolic sizes.


class _AbandonedInEnter:
    """An iterator for contextlib's `__enter__`: runs torch's generator to its yield,
    then the interrupt arrives, with nothing but contextlib's frame holding it."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        self.gen = unset_fake_temporarily.__wrapped__()

    def __next__(self) -> Any:
        gen = self.gen
        del self
        next(gen)
        del gen
        raise KeyboardInterrupt


_interrupt_in_fake_kernel: dict = {"armed": False, "masked": False}


def _scale_op() -> Any:
    import torch
    op = getattr(_scale_op, "op", None)
    if op is not None:
        return op

    # (The schema spelled out: this file's annotations are strings.)
    @torch.library.custom_op("nnscaler_test::scale_interrupted", mutates_args=(),
                             schema="(Tensor x) -> Tensor")
    def scale(x):
        return x * 2

    @scale.register_fake
    def _(x):
        if _interrupt_in_fake_kernel["armed"]:
            _interrupt_in_fake_kernel["armed"] = False
            try:
                with contextlib.contextmanager(_AbandonedInEnter)():
                    pass
            finally:
                if _interrupt_in_fake_kernel["masked"]:
                    raise RuntimeError("torch's own cleanup failed while unwinding")
        return torch.empty_like(x)

    _scale_op.op = scale  # type: ignore[attr-defined]
    return scale


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_an_interrupt_inside_a_context_managers_enter_leaves_no_fake_mode_behind(masked):
    import gc

    import torch
    import torch.nn as nn

    import nnscaler
    from nnscaler_eval.capture import unwinding

    scale = _scale_op()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return scale(self.fc(x)) + 1

    fake_key = torch._C._TorchDispatchModeKey.FAKE
    before = unwinding.ModeState()
    model = nnscaler.compile(Model(), dynamic=True)
    eager, calm = Model(), nnscaler.compile(Model(), dynamic=True)   # calm: never interrupted
    eager.load_state_dict(model.state_dict())
    calm.load_state_dict(model.state_dict())
    try:
        _interrupt_in_fake_kernel.update(armed=True, masked=masked)
        # Ctrl-C reaches the caller as KeyboardInterrupt: neither taken for an op
        # refusing symbols (a static capture would run on), nor masked by torch's error.
        with pytest.raises(KeyboardInterrupt):
            model(torch.randn(5, 4))
        assert not _interrupt_in_fake_kernel["armed"]
        assert torch._C._get_dispatch_mode(fake_key) is None
        gc.collect()   # a generator left suspended in a cycle would run its finally now
        assert torch._C._get_dispatch_mode(fake_key) is None
        assert torch._C._len_torch_dispatch_stack() == before.dispatch_depth
        assert torch._C._len_torch_function_stack() == before.function_depth
        for n in (3, 7):
            x = torch.randn(n, 4)
            assert not isinstance(eager(x), torch._subclasses.FakeTensor)
            torch.testing.assert_close(model(x), eager(x))
            torch.testing.assert_close(calm(x), eager(x))
        # As if the interrupted call had never been made.
        assert nnscaler.cache_info(model).captures == nnscaler.cache_info(calm).captures
    finally:
        _interrupt_in_fake_kernel["armed"] = False
        before.restore()


def test_an_interrupt_inside_an_exports_capture_leaves_no_fake_mode_behind():
    """nnscaler.export's symbolic capture crosses the same boundary."""
    import gc

    import torch
    import torch.nn as nn

    import nnscaler
    from nnscaler_eval.capture import unwinding

    scale = _scale_op()

    class Model(nn.Module):
        def forward(self, x):
            return scale(x) + 1

    fake_key = torch._C._TorchDispatchModeKey.FAKE
    before = unwinding.ModeState()
    try:
        _interrupt_in_fake_kernel.update(armed=True, masked=True)
        with pytest.raises(KeyboardInterrupt):
            nnscaler.export(Model(), torch.randn(5, 4), dynamic_dims={"x": 0})
        gc.collect()
        assert torch._C._get_dispatch_mode(fake_key) is None
        assert torch._C._len_torch_dispatch_stack() == before.dispatch_depth
        assert torch._C._len_torch_function_stack() == before.function_depth
        gm = nnscaler.export(Model(), torch.randn(5, 4), dynamic_dims={"x": 0})
        x = torch.randn(7, 4)
        torch.testing.assert_close(gm(x), x * 2 + 1)
    finally:
        _interrupt_in_fake_kernel["armed"] = False
        before.restore()


if __name__ == "__main__" and sys.argv[1:2] == [CHILD_FLAG]:
    result = _child(int(sys.argv[2]), int(sys.argv[3]), nested=sys.argv[4] == "nested",
                    symbolic=sys.argv[4] == "symbolic", signame=sys.argv[5])
    sys.stdout.flush()
    print(json.dumps(result))
