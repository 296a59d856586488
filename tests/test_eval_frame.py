"""The PEP 523 hook: arming, nesting, threads, and what is never intercepted."""
from __future__ import annotations

import sys
import threading

import pytest
import torch

import nnscaler
from nnscaler_eval import _C


class Drop(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = 0.5

    def forward(self, x):
        return x * 2 if self.training else x + 1

    def scale(self):
        return self.p if self.training else 0.0


def test_default_evaluator_outside_armed_regions():
    assert _C.is_default_eval_frame()
    with nnscaler.eval_frame.enable():
        assert not _C.is_default_eval_frame()
        assert _C.eval_frame_installed()
        with nnscaler.eval_frame.disable():
            assert _C.is_default_eval_frame()
        assert _C.eval_frame_installed()
    assert _C.is_default_eval_frame()
    assert _C.armed_threads() == 0


def test_rewrite_mode_runs_rewritten_code_and_disable_turns_it_off():
    m = Drop().eval()
    x = torch.ones(2)
    assert torch.equal(m(x), x + 1)
    with nnscaler.eval_frame.enable():
        assert torch.equal(m(x), x + 1)
        state = _C.code_state(Drop.forward.__code__)
        assert state["n_sites"] == 1 and state["rewritten"] is not None
        m.train()
        assert torch.equal(m(x), x * 2)
        assert m.scale() == 0.5
        with nnscaler.eval_frame.disable():
            assert torch.equal(m(x), x * 2)


class count_ifexpr_calls:
    """Counts calls of nnscaler.runtime.function.ifexpr on this thread (profile hook:
    nothing is patched, and a profile function does not stop interception)."""

    def __enter__(self):
        from nnscaler_eval.runtime import ifexpr

        self.calls = []
        code = ifexpr.__code__

        def profiler(frame, event, arg):
            if event == "call" and frame.f_code is code:
                self.calls.append(tuple(frame.f_locals[n] for n in code.co_varnames[:3]))

        self._previous = sys.getprofile()
        sys.setprofile(profiler)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._previous)


def test_rewrite_mode_calls_ifexpr():
    m = Drop().train()
    with count_ifexpr_calls() as counter:
        m.scale()
    assert counter.calls == []
    with count_ifexpr_calls() as counter:
        with nnscaler.eval_frame.enable():
            assert m.scale() == 0.5
    assert counter.calls == [(True, 0.5, 0.0)]


def test_decorators_and_nesting():
    m = Drop().train()

    @nnscaler.eval_frame.enable()
    def inside():
        assert _C.current_config() is not None
        return m.scale()

    @nnscaler.eval_frame.disable()
    def off():
        return _C.current_config()

    assert inside() == 0.5
    with nnscaler.eval_frame.enable():
        assert off() is None
        assert _C.current_config() is not None
    assert _C.current_config() is None


def test_enable_rejects_options_without_backend():
    with pytest.raises(TypeError, match="need a backend"):
        nnscaler.eval_frame.enable(fullgraph=True)


def test_disarm_token_misuse_is_a_clear_error():
    token = _C.arm(None)
    _C.disarm(token)
    with pytest.raises(RuntimeError, match="already used"):
        _C.disarm(token)
    with pytest.raises(TypeError, match="ArmToken"):
        _C.disarm(object())
    with pytest.raises(TypeError, match="code object"):
        _C.arm(None, 42)


def test_generators_and_coroutines_are_never_intercepted():
    class Gen(torch.nn.Module):
        def forward(self, n):
            for i in range(n):
                yield i if self.training else -i

    m = Gen().train()
    with nnscaler.eval_frame.enable():
        assert list(m(3)) == [0, 1, 2]
    state = _C.code_state(Gen.forward.__code__)
    assert state["skip"] is True and state["rewritten"] is None


def test_exceptions_propagate_with_user_line():
    class Bad(torch.nn.Module):
        def forward(self, x):
            y = x.missing if self.training else x  # the line the traceback names
            return y

    m = Bad().train()
    with nnscaler.eval_frame.enable():
        with pytest.raises(AttributeError) as info:
            m(torch.ones(1))
    frames = [(str(f.path), f.lineno, f.name) for f in info.traceback]
    assert any(f[0] == __file__ and f[2] == "forward" for f in frames)
    line = [f for f in info.traceback if f.name == "forward"][-1]
    assert "x.missing" in str(line.statement)
    # the rewrite evaluates both branches (the seeds' documented side effect), so the
    # error is raised in eval mode too; the thread stays usable afterwards
    with nnscaler.eval_frame.enable():
        with pytest.raises(AttributeError):
            m.eval()(torch.ones(1))
        assert Drop().eval()(torch.ones(1)).item() == 2


def test_settrace_active_still_runs_correctly():
    events = []

    def tracer(frame, event, arg):
        if frame.f_code.co_name == "forward":
            events.append(event)
        return tracer

    m = Drop().train()
    sys.settrace(tracer)
    try:
        with nnscaler.eval_frame.enable():
            out = m(torch.ones(2))
    finally:
        sys.settrace(None)
    assert torch.equal(out, torch.full((2,), 2.0))
    assert "call" in events and "return" in events


def test_breakpoint_inside_forward(monkeypatch):
    hits = []

    class WithBreak(torch.nn.Module):
        def forward(self, x):
            breakpoint()
            return x * 3 if self.training else x

    monkeypatch.setattr(sys, "breakpointhook", lambda *a, **k: hits.append(sys._getframe(1).f_code.co_name))
    with nnscaler.eval_frame.enable():
        out = WithBreak().train()(torch.ones(1))
    assert out.item() == 3 and hits == ["forward"]


def test_pdb_in_rewritten_frame_sees_user_lines():
    import io
    import pdb

    class Stepped(torch.nn.Module):
        def forward(self, x):
            pdb.Pdb(stdin=io.StringIO("p x\np self.training\nc\n"), stdout=out).set_trace()
            return x + 1 if self.training else x

    out = io.StringIO()
    with nnscaler.eval_frame.enable():
        res = Stepped().train()(torch.ones(1))
    sys.settrace(None)
    assert res.item() == 2
    text = out.getvalue()
    assert "tensor([1.])" in text and "True" in text
    assert __file__ in text or "test_eval_frame.py" in text


def test_threads_half_inside_enable():
    m = Drop().train()
    errors: list[BaseException] = []
    rewritten_outside: list[int] = []

    def worker(armed: bool) -> None:
        try:
            x = torch.ones(2)
            for _ in range(1000):
                if armed:
                    with nnscaler.eval_frame.enable():
                        assert _C.current_config() is not None
                        assert torch.equal(m(x), x * 2)
                else:
                    if _C.current_config() is not None:
                        rewritten_outside.append(1)
                    assert torch.equal(m(x), x * 2)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not rewritten_outside


def test_outside_enable_frames_are_not_rewritten():
    m = Drop().train()
    barrier = threading.Barrier(2)
    outside_calls = []

    def outside():
        with count_ifexpr_calls() as counter:
            barrier.wait()
            for _ in range(200):
                m.scale()
        outside_calls.extend(counter.calls)

    t = threading.Thread(target=outside)
    t.start()
    with count_ifexpr_calls() as counter:
        with nnscaler.eval_frame.enable():
            barrier.wait()
            for _ in range(200):
                m.scale()
    t.join()
    assert len(counter.calls) == 200
    assert outside_calls == []


def _plus_one(x):
    return x + 1


def _times_three(x):
    return x * 3


def _times_five(x):
    return x * 5


def test_a_target_frame_is_told_from_plain_frames_after_every_region_change():
    """The hook's fast path passes plain frames on from the last region it resolved
    (arming.h's hot slot).  A compiled call pushing its region (a target code) and
    popping it must each make the next frame resolve again: the target's frame is
    captured, and the same code called right after, outside that region, is not."""
    f = nnscaler.compile(_times_three, backend="eager")
    x = torch.ones(2)
    with nnscaler.eval_frame.enable():
        for _ in range(5):
            for _ in range(3):
                _plus_one(x)                         # the slot holds enable()'s region
            assert torch.equal(f(x), x * 3)          # a target: captured, then hits
            assert torch.equal(_times_three(x), x * 3)   # plain here: no capture, no hit
    for _ in range(2):
        _plus_one(x)
        assert torch.equal(f(x), x * 3)
    info = nnscaler.cache_info(f)
    assert (info.captures, info.hits, info.misses) == (1, 6, 1)


def test_threads_taking_turns_each_resolve_their_own_region():
    """One thread calls a compiled function, another calls the same function's code
    plainly in a region of its own: the GIL switching between them every few
    microseconds, each compiled call is a capture or a hit and no plain call is."""
    f = nnscaler.compile(_times_five, backend="eager")
    x = torch.ones(2)
    errors: list[BaseException] = []
    calls = 300

    def compiled() -> None:
        try:
            for _ in range(calls):
                _plus_one(x)
                assert torch.equal(f(x), x * 5)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def plain() -> None:
        try:
            with nnscaler.eval_frame.enable():
                for _ in range(calls):
                    _plus_one(x)
                    assert torch.equal(_times_five(x), x * 5)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=compiled), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    info = nnscaler.cache_info(f)
    assert info.captures == 1 and info.captures + info.hits == calls


def test_recursion():
    class Tree(torch.nn.Module):
        def __init__(self, depth: int) -> None:
            super().__init__()
            self.child = Tree(depth - 1) if depth else None

        def forward(self, x):
            y = x * 2 if self.training else x
            return self.child(y) if self.child is not None else y

    m = Tree(20).train()
    with nnscaler.eval_frame.enable():
        assert m(torch.ones(1)).item() == 2 ** 21


HANG_SCRIPT = r"""
import torch, torch.nn as nn, nnscaler

class Mutating(nn.Module):
    def forward(self, x):
        def bad(a):
            a.add_(1)
            return a
        return torch.cond(x.sum() > 0, lambda a: a + 1, bad, (x,))

m = nnscaler.compile(Mutating())
for _ in range(3):
    try:
        m(torch.ones(2, 3))
    except Exception as exc:
        print("raised", type(exc).__name__, flush=True)
fn = torch.compile(lambda x: x * 2, backend="eager")
with nnscaler.eval_frame.enable(backend="eager"):
    print("dynamo inside armed region", fn(torch.ones(1)).item(), flush=True)
"""


def test_dynamo_swapping_evaluators_under_an_armed_region_does_not_hang():
    """Eager torch.cond runs torch.compile inside our capture; Dynamo swaps the
    interpreter's evaluator underneath us. Calls after an exception used to loop
    forever between its shim and ours (run in a subprocess: a hang must not hang
    the suite)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", HANG_SCRIPT], capture_output=True,
                         text=True, timeout=240)
    lines = [l for l in out.stdout.splitlines() if l.startswith(("raised", "dynamo"))]
    assert len([l for l in lines if l.startswith("raised")]) == 3, out.stdout + out.stderr
    assert "dynamo inside armed region 2.0" in lines, out.stdout + out.stderr
