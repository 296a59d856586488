"""C core hardening: references held across Python, arming per context, errors that
must propagate, cache owners, depth, and what the C core keeps alive.

Cases that crashed (or could) run in a subprocess with a timeout, so that a crash
fails one test instead of the suite."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import os
import subprocess
import sys
import textwrap
import threading
import warnings
import weakref
from typing import Optional

import pytest
import torch

import nnscaler
from nnscaler_eval import _C
from nnscaler_eval.shared_objects import REWRITE_MODE
from nnscaler_eval.config import CompileConfig
from models import meddling_training


def run_script(code: str, timeout: int = 180) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stdout}\n{out.stderr[-4000:]}"
    return out


# ----------------------------------------------------- 1. no borrowed references

RESET_DURING_CALL = r"""
import gc, torch, nnscaler

class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1

TRIGGER = [False]

def meddle():
    if TRIGGER[0]:
        nnscaler.reset()          # frees every bucket and entry of the caches
        models.clear()            # drops the caller's last reference to the model
        gc.collect()
        [bytearray(64) for _ in range(2000)]   # reuse what was freed

class ViaProperty(torch.Tensor):
    @property
    def dtype(self):              # read by the C call key
        meddle()
        return super().dtype

class ViaTorchFunction(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        meddle()
        return super().__torch_function__(func, types, args, kwargs or {})

for kind in (ViaProperty, ViaTorchFunction):
    for round in range(3):
        models = [nnscaler.compile(Model())]
        plain = torch.arange(4.0)
        TRIGGER[0] = False
        models[0](plain)          # capture: the bucket now has an entry
        models[0](plain)          # hit
        x = plain.clone().as_subclass(kind)
        TRIGGER[0] = True
        m = models[0]
        out = m(x)                # hit path: the key getters reset() the caches
        TRIGGER[0] = False
        expected = plain * 2 + 1
        assert torch.equal(out.as_subclass(torch.Tensor), expected), (kind, out, expected)
print("ok")
"""


def test_reset_and_module_deletion_during_the_call_key():
    """A tensor-subclass getter run by the C call key calls nnscaler.reset() and drops
    the module: the hit path held the bucket borrowed across it (use-after-free)."""
    out = run_script(RESET_DURING_CALL)
    assert out.stdout.strip().endswith("ok")


# A module whose `training` property resets every cache when `meddle` is set: the
# guards and the runner read it on a hit (test_dynamic_shapes uses it too).
FLAKY = r"""
import gc, torch, nnscaler

class Flaky(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.meddle = False

    @property
    def training(self):
        if self.__dict__.get("meddle"):
            nnscaler.reset()
            gc.collect()
        return self.__dict__.get("_t", True)

    @training.setter
    def training(self, value):
        self.__dict__["_t"] = value
"""

RESET_FROM_TRAINING = FLAKY + r"""
Flaky.forward = lambda self, x: x * 2 if self.training else x + 1

m = nnscaler.compile(Flaky())
x = torch.arange(3.0)
for meddle in (False, False, True, True, False, True):
    m.meddle = meddle
    assert torch.equal(m(x), x * 2), m(x)
print("ok")
"""


def test_reset_while_reading_training_flags():
    """Guards and the runner read `training` (a property may run Python)."""
    out = run_script(RESET_FROM_TRAINING)
    assert out.stdout.strip().endswith("ok")


MANY_ARGS_MEDDLING = r"""
import gc, torch, nnscaler

N = 70   # past the 64 slots a frameless hit keeps on the C stack: a PyMem block
names = ", ".join(f"x{i}" for i in range(N))
ns = {}
exec(f"def doubled(self, {names}):\n"
     f"    s = sum(({names},))\n"
     f"    return s * 2 if self.training else s + 1\n"
     f"def tripled(self, {names}):\n"
     f"    return sum(({names},)) * 3\n", ns)
ran = []

class Meddling(torch.nn.Module):
    # Writing `pending` moves a dict the entry guards, so a hit checks every guard,
    # the training flag among them: the property runs inside the frameless hit,
    # takes its action out again (the guards then hold) and does it.
    pending = {}
    forward = ns["doubled"]

    @property
    def training(self):
        action = Meddling.pending.pop("do", None)
        if action is not None:
            ran.append(action)
        if action == "reset":
            nnscaler.reset()
            gc.collect()
        elif action == "reenter":      # the same compiled call, nested, many slots too
            assert torch.equal(M(*XS), sum(XS) * 2)
        elif action == "uncompile":    # the call's wrapper and the class's forward go
            self.__dict__.pop("_compiled_call_impl", None)
            type(self).forward = ns["tripled"]
            gc.collect()
        return self.__dict__.get("_t", True)

    @training.setter
    def training(self, value):
        self.__dict__["_t"] = value

M = nnscaler.compile(Meddling())
XS = [torch.full((3,), float(i)) for i in range(N)]
for _ in range(3):
    assert torch.equal(M(*XS), sum(XS) * 2)
assert nnscaler.cache_info(M).hits == 2          # frameless hits
for action in ("reset", None, None, "reenter", None, "reenter", None):
    if action is not None:
        Meddling.pending["do"] = action
    assert torch.equal(M(*XS), sum(XS) * 2), action
assert ran == ["reset", "reenter", "reenter"], ran
Meddling.pending["do"] = "uncompile"
got = M(*XS)     # the graph's answer, or eager's with the new forward
assert torch.equal(got, sum(XS) * 2) or torch.equal(got, sum(XS) * 3), got
assert ran[-1] == "uncompile"
for _ in range(3):
    assert torch.equal(M(*XS), sum(XS) * 3)
print("ok")
"""


def test_python_in_the_middle_of_a_frameless_hit_with_many_arguments():
    """A frameless hit of 70 tensors (its slots in a PyMem block) whose guard check
    runs Python: reset() and a collection, the same compiled call nested, the
    compiled call removed and the class's forward replaced.  Every answer is the
    graph's or eager's, the block is freed on every path (`make asan` runs this)."""
    out = run_script(MANY_ARGS_MEDDLING)
    assert out.stdout.strip().endswith("ok"), out.stdout + out.stderr


# ------------------------------------------------ 2. the rewrite-mode sentinel

DROPPED_TOKEN_IN_CAPTURE = r"""
import gc, sys, torch, nnscaler
from nnscaler_eval import _C
from nnscaler_eval.shared_objects import REWRITE_MODE

class Model(torch.nn.Module):
    def forward(self, x):
        _C.arm(None)            # a disable() token dropped at once
        return x + 1

x = torch.ones(2)
before = sys.getrefcount(REWRITE_MODE)
for _ in range(50):
    assert torch.equal(nnscaler.compile(Model())(x), x + 1)
_C.disarm(_C.arm(None))     # the last closed region stays the context's value until then
gc.collect()
after = sys.getrefcount(REWRITE_MODE)
assert after == before, (before, after)
assert _C.armed_threads() == 0 and _C.current_config() is None
print("ok")
"""


def test_tokens_dropped_inside_a_capture_leave_the_sentinel_alone():
    """While convert_frame runs, the thread is in rewrite mode; a token taken there
    and dropped without disarm() released a reference to the rewrite-mode sentinel
    that it never owned (after a few calls: the sentinel freed while in use)."""
    out = run_script(DROPPED_TOKEN_IN_CAPTURE)
    assert out.stdout.strip().endswith("ok")


# ------------------------------------------------------- 3. arming per context

def test_asyncio_tasks_interleaving_enable_blocks():
    m = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    expected = m(x)
    seen: dict[str, list] = {"a": [], "b": []}

    async def task(name: str, entered: asyncio.Event, go: asyncio.Event) -> None:
        with nnscaler.eval_frame.enable(backend="eager"):
            seen[name].append(_C.current_config() is not None)
            entered.set()
            await go.wait()
            seen[name].append(_C.current_config() is not None)
            with torch.no_grad():
                seen[name].append(torch.allclose(m(x), expected))
        seen[name].append(_C.current_config() is None)

    async def main() -> None:
        a_in, b_in, a_go, b_go = (asyncio.Event() for _ in range(4))
        ta = asyncio.create_task(task("a", a_in, a_go))
        await a_in.wait()
        tb = asyncio.create_task(task("b", b_in, b_go))
        await b_in.wait()
        # a leaves its block while b is still inside its own, then b leaves.
        a_go.set()
        await ta
        assert _C.eval_frame_installed() and _C.armed_threads() == 1
        assert _C.current_config() is None   # main's context was never armed
        b_go.set()
        await tb

    asyncio.run(main())
    assert seen == {"a": [True, True, True, True], "b": [True, True, True, True]}
    assert _C.armed_threads() == 0
    assert not _C.eval_frame_installed()
    assert _C.current_config() is None


def test_one_enable_object_shared_by_two_tasks():
    cm = nnscaler.eval_frame.enable()

    async def task(first: asyncio.Event, second: asyncio.Event) -> None:
        with cm:
            first.set()
            await second.wait()

    async def main() -> None:
        e1, e2, e3, e4 = (asyncio.Event() for _ in range(4))
        t1 = asyncio.create_task(task(e1, e2))
        await e1.wait()
        t2 = asyncio.create_task(task(e3, e4))
        await e3.wait()
        e2.set()
        await t1
        e4.set()
        await t2

    asyncio.run(main())
    assert _C.armed_threads() == 0 and not _C.eval_frame_installed()


def test_a_thread_that_ends_armed_is_cleaned_up():
    kept: list = []

    def leave_open() -> None:
        kept.append(_C.arm(CompileConfig.create()))     # token outlives the thread
        cm = nnscaler.eval_frame.enable()
        cm.__enter__()                                  # a `with` never exited
        kept.append(cm)
        assert _C.armed_threads() == 1 and _C.eval_frame_installed()

    t = threading.Thread(target=leave_open)
    t.start()
    t.join()
    assert _C.armed_threads() == 0
    assert not _C.eval_frame_installed()
    assert _C.current_config() is None
    with pytest.raises(RuntimeError, match="thread that armed this token has ended"):
        _C.disarm(kept[0])


def test_out_of_order_token_use_is_refused():
    t1 = _C.arm(REWRITE_MODE)
    t2 = _C.arm(None)
    with pytest.raises(RuntimeError, match="out of order"):
        _C.disarm(t1)
    assert _C.current_config() is None          # still inside t2's disable()
    _C.disarm(t2)
    assert _C.current_config() is REWRITE_MODE
    _C.disarm(t1)
    assert _C.current_config() is None and _C.armed_threads() == 0


def test_token_used_on_another_thread_or_context_is_refused():
    token = _C.arm(REWRITE_MODE)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            _C.disarm(token)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "per thread" in str(errors[0])
    _C.disarm(token)

    ctx = contextvars.copy_context()
    inner = ctx.run(_C.arm, REWRITE_MODE)
    assert _C.current_config() is None           # armed in ctx, not here
    with pytest.raises(RuntimeError, match="another context"):
        _C.disarm(inner)
    ctx.run(_C.disarm, inner)
    assert _C.armed_threads() == 0


def test_a_dropped_token_closes_its_region():
    _C.arm(REWRITE_MODE)
    assert _C.current_config() is None
    assert _C.armed_threads() == 0 and not _C.eval_frame_installed()
    outer = _C.arm(REWRITE_MODE)
    _C.arm(None)                                  # dropped disable()
    assert _C.current_config() is REWRITE_MODE
    _C.disarm(outer)                              # closed regions above are skipped
    assert _C.armed_threads() == 0


def test_enable_inside_a_compiled_call_wins_until_it_exits():
    seen = []

    class Inner(torch.nn.Module):
        def forward(self, x):
            seen.append(_C.current_config())
            with nnscaler.eval_frame.disable():
                seen.append(_C.current_config())
                assert _C.is_default_eval_frame() or not _C.eval_frame_installed()
            seen.append(_C.current_config())
            return x + 1

    m = nnscaler.compile(Inner())
    m(torch.ones(1))
    assert seen[1] is None and seen[0] is not None and seen[2] is seen[0]


# ---------------------------------------------- 4. errors that must propagate

def _raising_tensor(exc_type: type) -> torch.Tensor:
    class Raising(torch.Tensor):
        @property
        def dtype(self):
            raise exc_type("from a dtype getter")

    return torch.ones(2).as_subclass(Raising)


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit, MemoryError,
                                      GeneratorExit])
def test_base_exceptions_are_not_turned_into_warnings(exc_type):
    class Model(torch.nn.Module):
        def forward(self, x):
            return x + 1

    m = nnscaler.compile(Model())
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a warning instead would fail differently
        with pytest.raises(exc_type, match="from a dtype getter"):
            m(_raising_tensor(exc_type))
    assert _C.armed_threads() == 0


def test_ordinary_errors_fail_open_with_a_warning():
    class Model(torch.nn.Module):
        def forward(self, x):
            return x + 1

    m = nnscaler.compile(Model())
    with pytest.warns(RuntimeWarning, match="ValueError.*from a dtype getter"):
        out = m(_raising_tensor(ValueError))
    assert torch.equal(out.as_subclass(torch.Tensor), torch.full((2,), 2.0))


# --------------------------------------------------- 7. owners of cache buckets

def test_closures_of_one_code_object_have_their_own_caches():
    def make(k):
        def scale(x):
            return x * k
        return scale

    x = torch.ones(2)
    two, three = nnscaler.compile(make(2)), nnscaler.compile(make(3))
    for _ in range(3):
        assert torch.equal(two(x), x * 2)
        assert torch.equal(three(x), x * 3)
    info2, info3 = nnscaler.cache_info(two), nnscaler.cache_info(three)
    assert info2.captures == 1 and info2.hits == 2
    assert info3.captures == 1 and info3.hits == 2


def test_compiling_again_with_another_backend_calls_that_backend():
    calls: list[int] = []

    def recording(gm, example_inputs):
        calls.append(len(example_inputs))
        return gm.forward

    def add_one(x):
        return x + 1

    x = torch.ones(2)
    first = nnscaler.compile(add_one)
    assert torch.equal(first(x), x + 1) and torch.equal(first(x), x + 1)
    second = nnscaler.compile(add_one, backend=recording)
    assert torch.equal(second(x), x + 1) and torch.equal(second(x), x + 1)
    assert calls == [1]
    assert torch.equal(first(x), x + 1)          # the first keeps its own entry
    assert calls == [1]

    class Model(torch.nn.Module):
        def forward(self, x):
            return x - 1

    m = nnscaler.compile(Model())
    m(x)
    nnscaler.compile(m, backend=recording)
    assert torch.equal(m(x), x - 1)
    assert calls == [1, 1]


def test_function_bucket_dies_with_its_function():
    def make(k):
        def scale(x):
            return x * k
        return scale

    fn = make(5)
    compiled = nnscaler.compile(fn)
    compiled(torch.ones(1))
    code = fn.__code__
    ref = weakref.ref(fn)
    del fn, compiled
    gc.collect()
    assert ref() is None
    state = _C.code_state(code)
    assert all(b.dead or b.self is not None for b in state["buckets"])


# ------------------------------------------------ 6. nothing kept alive from C

class _HookedChild(torch.nn.Module):
    def forward(self, x):
        return x + 1


class _SelfHookingRoot(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = _HookedChild()
        self.child.register_forward_hook(self.double)   # child -> bound method -> root

    def double(self, module, inputs, output):
        return output * 2

    def forward(self, x):
        return self.child(x) - 1


def _collected(make) -> bool:
    ref = make()
    gc.collect()
    return ref() is None


def test_compiled_wrappers_hold_no_cycle_hidden_from_the_gc():
    def module_compiled_not_called():
        root = nnscaler.compile(_SelfHookingRoot())   # root -> ModuleCall -> root
        return weakref.ref(root)

    def module_call_after_calls_without_hooks():
        m = nnscaler.compile(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        m(torch.ones(1, 2))
        m(torch.ones(1, 2))
        return weakref.ref(m)

    assert _collected(module_compiled_not_called)
    assert _collected(module_call_after_calls_without_hooks)


class _Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))

    def forward(self, x):
        return self.inner(x) * (2.0 if self.training else 1.0)


def test_compiled_module_is_freed_by_its_last_reference_like_an_eager_one():
    # No cycle through the compiled call or the capture's leftovers: `del model`
    # frees the module (and, for a DDP/FSDP wrapper, its process group) at once, not
    # at whatever cyclic collection comes next (which may be interpreter shutdown).
    # Its parameters are also held by the generated runner (fx code is cyclic): they
    # go at the next collection.
    gc.disable()
    try:
        for train in (True, False):
            m = nnscaler.compile(_Nested().train(train))
            for _ in range(3):
                m(torch.ones(3, 2))
            weight = weakref.ref(m.inner[0].weight)
            ref = weakref.ref(m)
            del m
            assert ref() is None
            gc.collect()
            assert weight() is None
    finally:
        gc.enable()


def _drop_itself(module):
    if _DropsItself.holder.pop("armed", False):
        module.__dict__.pop("_compiled_call_impl", None)
        _DropsItself.holder.pop("module", None)
        gc.collect()


class _DropsItself(torch.nn.Module):
    """Its training flag, read by the tracer (capture) or the guards (hit), drops the
    last other reference to the module and its compiled call, and collects."""

    holder: dict = {}
    training = meddling_training(_drop_itself)

    def forward(self, x):
        return x * 2 if self.training else x + 1


@pytest.mark.parametrize("when", [0, 2])   # the capture; a hit (frameless)
def test_a_module_dropped_while_its_compiled_call_runs_finishes_the_call(when):
    holder = _DropsItself.holder
    m = nnscaler.compile(_DropsItself())
    call = m._compiled_call_impl
    ref = weakref.ref(m)
    holder["module"] = m
    del m
    x = torch.ones(2)
    for i in range(when + 1):
        holder["armed"] = i == when
        assert torch.equal(call(x), x * 2)
    assert ref() is None   # the call held it, and let go
    with pytest.raises(ReferenceError):
        call(x)


def test_a_compiled_call_outliving_its_module_says_so():
    m = nnscaler.compile(torch.nn.Linear(2, 2))
    call = m._compiled_call_impl
    del m
    gc.collect()
    with pytest.raises(ReferenceError, match="module was garbage-collected"):
        call(torch.ones(2))
    with pytest.raises(ReferenceError, match="module was garbage-collected"):
        call.__reduce__()
    m = nnscaler.compile(torch.nn.Linear(2, 2))   # still usable afterwards
    assert m(torch.ones(2)).shape == (2,)


def test_function_referring_to_its_wrapper_through_a_closure_is_collectable():
    def function_referring_to_its_wrapper():
        box: list = []

        def step(x):
            return x + len(box)

        compiled = nnscaler.compile(step)
        box.append(compiled)                          # step -> box -> wrapper -> step
        assert torch.equal(compiled(torch.zeros(1)), torch.ones(1))
        assert torch.equal(compiled(torch.zeros(1)), torch.ones(1))
        return weakref.ref(step)

    assert _collected(function_referring_to_its_wrapper)


def test_root_with_its_own_bound_method_as_a_child_hook_is_collectable():
    def make():
        root = nnscaler.compile(_SelfHookingRoot())
        x = torch.ones(1)
        assert torch.equal(root(x), x * 2 + 1)
        assert torch.equal(root(x), x * 2 + 1)
        return weakref.ref(root)

    assert _collected(make)


class _Leaf(torch.nn.Module):
    def forward(self, x):
        return x + 1


class _Middle(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaf = _Leaf()

    def forward(self, x):
        return self.leaf(x) * 3


class _GrandparentHooking(torch.nn.Module):
    """root -> middle -> leaf, and leaf's hook is a bound method of root: the cycle
    runs through the middle module's own cache entry, not the root's."""

    def __init__(self) -> None:
        super().__init__()
        self.middle = _Middle()
        self.middle.leaf.register_forward_hook(self.double)

    def double(self, module, inputs, output):
        return output * 2

    def forward(self, x):
        return self.middle(x) - 1


def test_cycle_through_a_submodule_entry_is_collectable():
    def make():
        root = nnscaler.compile(_GrandparentHooking())
        x = torch.ones(1)
        for _ in range(3):
            assert torch.equal(root(x), (x + 1) * 2 * 3 - 1)
        return weakref.ref(root)

    assert _collected(make)


def test_enable_region_caches_do_not_keep_modules_alive():
    def in_a_block():
        root = _SelfHookingRoot()
        x = torch.ones(1)
        region = nnscaler.eval_frame.enable(backend="eager")
        captures = []
        for _ in range(2):
            with region:   # one region object, one config: its caches are reused
                for _ in range(3):
                    assert torch.equal(root(x), x * 2 + 1)
            captures.append(nnscaler.cache_info(root).captures)
        assert captures[0] >= 1 and captures[1] == captures[0]
        return weakref.ref(root)

    def under_a_live_decorator():
        root = _SelfHookingRoot()
        step = nnscaler.eval_frame.enable(backend="eager")(lambda x: root(x))
        root.step = step                    # root -> step -> config -> caches -> root
        x = torch.ones(1)
        for _ in range(3):
            assert torch.equal(root.step(x), x * 2 + 1)
        assert nnscaler.cache_info(root).hits >= 1
        return weakref.ref(root)

    assert _collected(in_a_block)
    assert _collected(under_a_live_decorator)


def _homes(module: torch.nn.Module) -> list:
    call = module.__dict__["_compiled_call_impl"]
    return [o for o in gc.get_referents(call) if type(o) is list]


def test_reset_retires_the_buckets_a_compiled_module_owns():
    m = nnscaler.compile(_Middle())
    x = torch.ones(2)
    for _ in range(50):
        assert torch.equal(m(x), (x + 1) * 3)
        assert torch.equal(m(x), (x + 1) * 3)
        info = nnscaler.cache_info(m)
        assert (info.captures, info.hits) == (1, 1)
        nnscaler.reset()
        assert nnscaler.cache_info(m) == nnscaler.cache_info(_Leaf())   # all zero
    (home,) = _homes(m)
    assert len(home) <= 2   # retired buckets leave the home on its next capture


class _Scaled(torch.nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = torch.nn.Parameter(torch.tensor(k))

    def forward(self, x):
        return x * self.k


def test_hundreds_of_instances_find_their_own_buckets_and_reused_addresses_do_not():
    Compiled = nnscaler.compile(type("Compiled", (_Scaled,), {}))
    x = torch.ones(3)
    with torch.no_grad():
        models = [Compiled(float(i)) for i in range(600)]
        for _ in range(2):
            for i, m in enumerate(models):
                assert torch.equal(m(x), x * i)
        assert all(nnscaler.cache_info(m)[:2] == (1, 1) for m in models)
        # Free half; new instances often take the freed addresses.
        del models[::2]
        gc.collect()
        fresh = [Compiled(-float(i)) for i in range(300)]
        for i, m in enumerate(fresh):
            assert torch.equal(m(x), x * -i)
            assert nnscaler.cache_info(m)[:2] == (1, 0)
        for m in models:
            assert nnscaler.cache_info(m)[:2] == (1, 1)


def test_a_child_shared_by_two_roots_outlives_the_root_that_captured_it():
    Root = nnscaler.compile(type("Root", (torch.nn.Module,), {
        "__init__": lambda self, child: (torch.nn.Module.__init__(self),
                                         setattr(self, "child", child))[0],
        "forward": lambda self, x: self.child(x) + 1,
    }))
    shared = _Middle()
    a, b = Root(shared), Root(shared)
    x = torch.ones(2)
    assert torch.equal(a(x), (x + 1) * 3 + 1)
    assert torch.equal(b(x), (x + 1) * 3 + 1)
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None
    for _ in range(2):
        assert torch.equal(b(x), (x + 1) * 3 + 1)
    shared.leaf.register_forward_hook(lambda mod, inputs, out: out * 10)
    assert torch.equal(b(x), (x + 1) * 10 * 3 + 1)


# ------------------------------------------------------------------- 8. asan

def test_asan_target_runs_with_the_system_allocator():
    """pymalloc hides freed small objects from ASan: `make asan` must set
    PYTHONMALLOC=malloc for the run (and so for the subprocess crash cases)."""
    import pathlib

    makefile = (pathlib.Path(__file__).resolve().parents[1] / "Makefile").read_text()
    recipe = makefile.split("\nasan:", 1)[1].split("\n\n", 1)[0]
    run_line = recipe[recipe.index("ASAN_OPTIONS"):recipe.index("pytest")]
    assert "PYTHONMALLOC=malloc" in run_line


# ------------------------------------------------------------------- 5. depth

class _Level(torch.nn.Module):
    def __init__(self, child=None) -> None:
        super().__init__()
        self.child = child

    def forward(self, x):
        if self.child is None:
            return x
        return self.child(x + 1)


def _as_eager_runs():
    """Where eager's recursion figures are taken.  CPython 3.12 charges its C
    recursion budget (1500 units) two units for every Python call it does not inline,
    and it inlines none while any PEP 523 evaluator is installed in the process (ours
    while any thread is armed, Dynamo's once torch.compile ran): Python recursion
    then stops near 750 frames whatever sys.getrecursionlimit() says.  3.11, 3.13 and
    3.14 do not.  So on 3.12 eager runs with an evaluator installed too (rewrite mode,
    which captures nothing), and the comparison is of our own frames, as elsewhere."""
    if sys.version_info[:2] == (3, 12):
        return nnscaler.eval_frame.enable()
    return contextlib.nullcontext()


# 3.12: the recursion credit (csrc/recursion.c) gives back the Python units our
# frames take, not the C units 3.12 also charges them (two per frame, see
# _as_eager_runs), so deep nesting of captures and opaque calls stops earlier than
# eager there.  Known and documented (README, limits); these tests say how far.
C_UNITS_NOT_CREDITED = pytest.mark.xfail(
    sys.version_info[:2] == (3, 12), strict=True,
    reason="CPython 3.12 charges C recursion units to our frames; not credited back")


def _headroom() -> int:
    """Frames that can still be entered here before RecursionError."""
    depth = 0

    def down():
        nonlocal depth
        depth += 1
        down()

    try:
        down()
    except RecursionError:
        pass
    return depth


def _headroom_at_leaf(levels: int, compiled: bool, hooks: bool) -> int:
    chain = [_Level()]
    for _ in range(levels):
        chain.insert(0, _Level(chain[0]))
    seen: list[int] = []
    for m in chain:
        if hooks:   # each level its own capture, called as an opaque node by its parent
            m.register_forward_hook(lambda mod, inputs, out: None)
        if compiled:
            nnscaler.compile(m)
    chain[-1].register_forward_hook(lambda mod, inputs, out: seen.append(_headroom()))
    with torch.no_grad(), (contextlib.nullcontext() if compiled else _as_eager_runs()):
        if compiled:
            for m in reversed(chain):   # capture bottom-up; the last call hits everywhere
                m(torch.zeros(1))
        seen.clear()
        assert chain[0](torch.zeros(1)).item() == levels
    return seen[-1]


@pytest.mark.parametrize("hooks", [False, True])
def test_nested_compiled_calls_use_no_more_recursion_than_eager(hooks):
    """Per level of nested compiled calls (cache hits), the recursion budget spent is
    at most eager's at the same sys.getrecursionlimit(): the intercepted forward's
    frame is replaced by the runner's, and the C wrapper and dispatch add none."""
    def per_level(compiled):
        return (_headroom_at_leaf(5, compiled, hooks) - _headroom_at_leaf(35, compiled, hooks)) / 30

    eager, ours = per_level(False), per_level(True)
    assert ours <= eager, (ours, eager)


def _first_call_headroom_at_leaf(levels: int, compiled: bool) -> int:
    chain = [_Level()]
    for _ in range(levels):
        chain.insert(0, _Level(chain[0]))
    seen: list[int] = []
    for m in chain:
        m.register_forward_hook(lambda mod, inputs, out: None)
        if compiled:
            nnscaler.compile(m)
    chain[-1].register_forward_hook(lambda mod, inputs, out: seen.append(_headroom()))
    with torch.no_grad(), (contextlib.nullcontext() if compiled else _as_eager_runs()):
        chain[0](torch.zeros(1))   # every level captured, nested
    return seen[-1]


@C_UNITS_NOT_CREDITED
def test_nested_first_calls_use_no_more_recursion_than_eager():
    """Per nested first call, convert_frame, the tracer and the module-call patch put
    their own frames between a forward and the next; the units they take are
    credited back for the user's code (csrc/recursion.h), so per level the capture
    costs the user what eager costs."""
    def per_level(compiled):
        return (_first_call_headroom_at_leaf(5, compiled)
                - _first_call_headroom_at_leaf(25, compiled)) / 20

    eager, ours = per_level(False), per_level(True)
    assert ours <= eager, (ours, eager)


@C_UNITS_NOT_CREDITED
def test_nested_first_calls_leave_as_much_headroom_as_eager():
    """Not only per level: at the leaf of a 25-deep first call the user has at least
    eager's headroom left."""
    eager = _first_call_headroom_at_leaf(25, compiled=False)
    ours = _first_call_headroom_at_leaf(25, compiled=True)
    assert ours >= eager, (ours, eager)


class _SelfRecursive(torch.nn.Module):
    """Calls itself `n` times through `self(...)`: each level its own nested capture
    (n is part of the key), called as an opaque node by the level above."""

    def __init__(self, reached: Optional[list] = None) -> None:
        super().__init__()
        self.reached = reached    # a list it changes is state: no entry is kept

    def forward(self, x, n: int):
        if self.reached is not None:
            self.reached.append(n)
        if n == 0:
            return x
        return self(x + 1, n - 1)


def _deepest(module: torch.nn.Module, reached: list, n: int = 10 ** 5) -> int:
    """Levels entered before RecursionError (which must come)."""
    reached.clear()
    with pytest.raises(RecursionError), torch.no_grad():
        module(torch.zeros(1), n)
    return len(reached)


def _runs(module: torch.nn.Module, n: int) -> bool:
    try:
        with torch.no_grad():
            out = module(torch.zeros(1), n)
    except RecursionError:
        return False
    assert out.item() == n
    return True


_UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")


@pytest.fixture
def default_recursion_limit():
    """CPython's default limit for the test, whatever an earlier test left (torch's
    inductor raises it to 2000 for good).  On 3.12+ eager's Python-to-Python calls
    take no C stack and no C-recursion unit, so a raised limit lets eager nest deeper
    than captures, whose frames all run under the evaluator, can: there the first call
    meets RecursionError at a C bound instead (README, "nests as deep as eager")."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(limit)


@C_UNITS_NOT_CREDITED
@pytest.mark.usefixtures("default_recursion_limit")
def test_self_recursive_forward_meets_recursion_error_no_earlier_than_eager():
    """The same limit, the same model: the first call (every level a nested capture)
    and the calls that hit the cache recurse at least as deep as eager before
    RecursionError, and raise it (no crash, no fallback swallowing it)."""
    reached: list[int] = []
    with _as_eager_runs():
        eager_levels = _deepest(_SelfRecursive(reached), reached)
    compiled = nnscaler.compile(_SelfRecursive(reached), cache_size_limit=10 ** 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # nothing of ours may fail near the limit
        first_levels = _deepest(compiled, reached)
    # Under ASan every C frame carries redzones (2-3x the stack), and the recursion
    # credit is given only while the C stack left can hold what the limit allows
    # (csrc/recursion.c): there a capture may stop some levels short of eager, with
    # RecursionError, never a crash.  Everywhere else: at least eager's depth.
    shortfall = int(eager_levels * 0.15) if _UNDER_ASAN else 0
    assert first_levels >= eager_levels - shortfall, (first_levels, eager_levels)

    # The deepest call eager completes: compiled completes it on the first call
    # (captures all the way down) and again from the cache, every level a hit.
    eager = _SelfRecursive()
    n = eager_levels - shortfall
    with _as_eager_runs():
        while not _runs(eager, n):
            n -= 1
    assert n >= eager_levels - shortfall - 3
    compiled = nnscaler.compile(_SelfRecursive(), cache_size_limit=10 ** 6)
    assert _runs(compiled, n)
    assert nnscaler.cache_info(compiled).captures == n + 1
    assert _runs(compiled, n)
    info = nnscaler.cache_info(compiled)
    assert info.captures == n + 1 and info.hits == n + 1, info
    # The cache changes nothing for a call eager cannot finish: RecursionError.
    with pytest.raises(RecursionError), torch.no_grad():
        compiled(torch.zeros(1), 10 ** 5)


DEEP_RECURSION = r"""
import sys, threading, warnings, torch, nnscaler
sys.setrecursionlimit(LIMIT)
warnings.simplefilter("ignore")

class Deep(torch.nn.Module):
    def forward(self, x, n: int):
        return x if n == 0 else self(x + 1, n - 1)

result = []

def run(compiled):
    m = Deep()
    if compiled:
        nnscaler.compile(m, cache_size_limit=10 ** 6)
    try:
        with torch.no_grad():
            m(torch.zeros(1), 100_000)
        result.append("no error")
    except RecursionError:
        result.append("RecursionError")

threading.stack_size(8 * 1024 * 1024)   # the same stack on every machine
for compiled in COMPILED:
    t = threading.Thread(target=run, args=(compiled,))
    t.start()
    t.join()
assert result == ["RecursionError"] * len(COMPILED), result
print("ok", result)
"""


@pytest.mark.parametrize("limit, compiled", [
    (1000, (False, True)),
    # Beyond what the stack holds for frames run under the evaluator (eager itself
    # crashes here on 3.11): credit is refused, and RecursionError comes before the
    # stack runs out.
    (10 ** 6, (True,)),
])
def test_recursing_100k_levels_under_capture_raises_recursion_error(limit, compiled):
    out = run_script(DEEP_RECURSION.replace("LIMIT", str(limit))
                     .replace("COMPILED", repr(compiled)), timeout=300)
    assert "ok" in out.stdout


class _Boom(Exception):
    pass


@pytest.mark.parametrize("raised", [_Boom, KeyboardInterrupt])
def test_exception_in_a_nested_capture_gives_back_every_credited_unit(raised):
    """An exception or KeyboardInterrupt from the innermost of nested first calls
    leaves the recursion limit, this thread's recursion counter and torch's mode
    stack as they were."""
    chain = [_Level()]
    for _ in range(8):
        chain.insert(0, _Level(chain[0]))
    for m in chain:
        m.register_forward_hook(lambda mod, inputs, out: None)
        nnscaler.compile(m)

    def boom(mod, inputs, out):
        raise raised("from the leaf")

    chain[-1].register_forward_hook(boom)
    limit, depth = sys.getrecursionlimit(), _C.recursion_depth()
    headroom, modes = _headroom(), torch._C._len_torch_function_stack()
    with pytest.raises(raised), torch.no_grad():
        chain[0](torch.zeros(1))
    assert sys.getrecursionlimit() == limit
    assert _C.recursion_depth() == depth
    assert _headroom() == headroom
    assert torch._C._len_torch_function_stack() == modes


def test_credit_is_per_thread():
    """While a thread is deep in nested captures (credited), another thread's budget
    and the process-wide limit are what they were."""
    chain = [_Level()]
    for _ in range(10):
        chain.insert(0, _Level(chain[0]))
    inside, release = threading.Event(), threading.Event()

    def wait_at_leaf(mod, inputs, out):
        inside.set()
        assert release.wait(60)

    for m in chain:
        m.register_forward_hook(lambda mod, inputs, out: None)
        nnscaler.compile(m)
    chain[-1].register_forward_hook(wait_at_leaf)
    limit, headroom = sys.getrecursionlimit(), _headroom()
    with _as_eager_runs():   # 3.12: what any installed evaluator leaves (_as_eager_runs)
        headroom_beside_an_evaluator = _headroom()
    worker = threading.Thread(target=lambda: chain[0](torch.zeros(1)))
    worker.start()
    try:
        assert inside.wait(60)
        assert sys.getrecursionlimit() == limit
        assert _headroom() == headroom_beside_an_evaluator
    finally:
        release.set()
        worker.join(60)
    assert _headroom() == headroom


def test_call_at_depth_only_ever_gives():
    def depth_inside(*args, **kwargs):
        return _C.recursion_depth(), args, kwargs

    def nested(levels, fn):
        return nested(levels - 1, fn) if levels else fn()

    here = _C.recursion_depth()
    # from 30 frames deeper, as if called from here: fn's frame is here + 1
    got = nested(30, lambda: _C.call_at_depth(here, depth_inside, 1, depth=2))
    assert got == (here + 1, (1,), {"depth": 2})
    # a depth below the caller's: nothing is taken away
    assert _C.call_at_depth(here + 50, depth_inside)[0] > here
    # no depth, or an implausible one (not a hand-over of ours): a plain call
    assert nested(30, lambda: _C.call_at_depth(None, depth_inside))[0] > here + 30
    assert nested(300, lambda: _C.call_at_depth(here, depth_inside))[0] > here + 300
    # the credit is given back however fn ends
    with pytest.raises(_Boom):
        nested(30, lambda: _C.call_at_depth(here, _raise_boom))
    assert _C.recursion_depth() == here


def _raise_boom():
    raise _Boom()


def test_nested_opaque_captures_keep_one_pass_through_mode():
    """A suspended trace (its opaque child runs for real) has its mode replaced by
    one shared pass-through: the ops of a capture nested ten deep go through two
    modes (its own and the pass-through), not one per enclosing trace."""
    chain = [_Level()]
    for _ in range(10):
        chain.insert(0, _Level(chain[0]))
    seen: list[int] = []

    class Leaf(torch.nn.Module):
        def forward(self, x):
            seen.append(torch._C._len_torch_function_stack())
            return x * 2

    chain[-1].child = Leaf()
    for m in chain:
        m.register_forward_hook(lambda mod, inputs, out: None)
        nnscaler.compile(m)
    before = torch._C._len_torch_function_stack()
    with torch.no_grad():
        assert chain[0](torch.zeros(1)).item() == 22   # 11 levels add 1, the leaf doubles
    assert seen and seen[0] <= before + 2, seen
    assert torch._C._len_torch_function_stack() == before


class _ReadsRootFlag(torch.nn.Module):
    """Reads another module's `training` inside an opaque call: a training flag of
    the suspended trace, which the pass-through hands to torch as the plain bool."""

    def __init__(self, root_box: list) -> None:
        super().__init__()
        self.root_box = root_box

    def forward(self, x):
        return x + torch.full((1,), self.root_box[0].training).to(x.dtype), \
            torch.full((1,), self.root_box[0].training).dtype


def test_suspended_trace_pass_through_keeps_flags_plain():
    box: list = []
    root = torch.nn.Sequential(_ReadsRootFlag(box))
    box.append(root)
    root[0].register_forward_hook(lambda mod, inputs, out: None)   # opaque child
    eager = root(torch.zeros(1))
    nnscaler.compile(root)
    ours = root(torch.zeros(1))
    assert ours[1] == eager[1] == torch.bool
    assert torch.equal(ours[0], eager[0])


def test_disable_in_a_task_copied_from_an_armed_context_keeps_the_hook():
    """A task created inside enable() inherits the armed context; its own disable()
    must not uninstall the hook under the region still open in the parent task."""

    async def child(inside: asyncio.Event, release: asyncio.Event) -> None:
        assert _C.current_config() is REWRITE_MODE       # inherited
        with nnscaler.eval_frame.disable():
            assert _C.current_config() is None
            inside.set()
            await release.wait()

    async def main() -> None:
        with nnscaler.eval_frame.enable():
            inside, release = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(child(inside, release))
            await inside.wait()
            assert _C.current_config() is REWRITE_MODE
            assert _C.eval_frame_installed()
            release.set()
            await task
            assert _C.eval_frame_installed()

    asyncio.run(main())
    assert _C.armed_threads() == 0 and not _C.eval_frame_installed()


# ------------------------------------------- Python in the hit path's fast reads

class _FlagProperty(torch.nn.Module):
    """`training` as a property: the instance __dict__ value must not be used."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.drop = torch.nn.Dropout(0.5)

    @property
    def training(self):   # type: ignore[override]
        self.reads += 1
        return self.__dict__.get("_mode", True)

    @training.setter
    def training(self, value):
        self.__dict__["_mode"] = value

    def forward(self, x):
        return x * 2 if self.training else x * 3


def test_training_property_is_read_through_python_on_hits():
    m = nnscaler.compile(_FlagProperty())
    x = torch.ones(2)
    assert torch.equal(m(x), x * 2) and torch.equal(m(x), x * 2)
    before = m.reads
    m.eval()
    assert torch.equal(m(x), x * 3)
    assert m.reads > before


class _LoudGetattribute(torch.nn.Linear):
    def __getattribute__(self, name):
        if name == "training":
            object.__getattribute__(self, "__dict__").setdefault("_seen", 0)
            object.__getattribute__(self, "__dict__")["_seen"] += 1
        return super().__getattribute__(name)


def test_custom_getattribute_and_instance_forward_are_honoured():
    m = nnscaler.compile(_LoudGetattribute(2, 2))
    x = torch.ones(1, 2)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, m.weight, m.bias)
        assert torch.equal(m(x), expected) and torch.equal(m(x), expected)
        # An instance attribute `forward` wins over the class's, as in eager.
        m.forward = lambda x: x * 7
        assert torch.equal(m(x), x * 7)
        del m.forward
        assert torch.equal(m(x), expected)
        # The class changes under the cached per-type decision.
        type(m).forward = lambda self, x: x - 1
        try:
            assert torch.equal(m(x), x - 1)
        finally:
            del type(m).forward
        assert torch.equal(m(x), expected)


class _ResetsAndCallsOnDel:
    """Its finaliser runs Python in the middle of a miss: reset() every cache and
    call other instances of the same compiled class (new buckets in the very table
    the miss is adding to)."""

    def __init__(self, others):
        self.others = others

    def __del__(self):
        nnscaler.reset()
        for m in self.others:
            m(torch.ones(2))


def test_finalisers_that_reset_and_recapture_during_a_miss():
    Compiled = nnscaler.compile(type("Compiled", (_Scaled,), {}))
    others = [Compiled(2.0) for _ in range(3)]

    class Dropping(_Scaled):
        def forward(self, x):
            box = [_ResetsAndCallsOnDel(others)]
            box.append(box)                 # a cycle: freed by a collection, anywhere
            del box
            gc.collect()                    # the finaliser runs inside this capture
            return x * self.k

    m = nnscaler.compile(Dropping(3.0))
    x = torch.ones(2)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(m(x), x * 3)
            for o in others:
                assert torch.equal(o(x), x * 2)
    m(x)   # still usable, nothing left half-made


# ------------------------------------------------- a lock held for one call, in C

def test_call_holding_holds_the_lock_for_the_call_only():
    lock = threading.Lock()
    seen = []

    def body(a, b=0):
        seen.append(lock.locked())
        return a + b

    assert _C.call_holding(lock, body, 1, b=2) == 3
    assert seen == [True] and not lock.locked()


def test_call_holding_releases_on_every_exit():
    lock = threading.RLock()

    def fails():
        raise KeyboardInterrupt   # what a signal handler raises mid-body

    with pytest.raises(KeyboardInterrupt):
        _C.call_holding(lock, fails)
    assert lock._recursion_count() == 0
    # reentrant: a nested hold on the same thread, both released
    assert _C.call_holding(lock, _C.call_holding, lock, lock._recursion_count) == 2
    assert lock._recursion_count() == 0


def test_call_holding_reports_bad_locks_and_calls_nothing_without_the_lock():
    calls = []

    class Refuses:
        def acquire(self):
            return False

        def release(self):
            calls.append("release")

    with pytest.raises(RuntimeError, match="returned without the lock"):
        _C.call_holding(Refuses(), calls.append, "called")
    assert calls == []

    class Interrupted:   # acquire interrupted while waiting: no lock, no call
        def acquire(self):
            raise KeyboardInterrupt

        def release(self):
            calls.append("release")

    with pytest.raises(KeyboardInterrupt):
        _C.call_holding(Interrupted(), calls.append, "called")
    assert calls == []
    with pytest.raises(AttributeError):
        _C.call_holding(object(), calls.append, "called")
    with pytest.raises(TypeError, match="call_holding"):
        _C.call_holding(threading.Lock())


def test_call_holding_keeps_the_calls_error_when_the_release_fails_too(monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)

    class BreaksOnRelease:
        def acquire(self):
            return True

        def release(self):
            raise RuntimeError("release failed")

    def fails():
        raise ValueError("the call's error")

    with pytest.raises(ValueError, match="the call's error"):
        _C.call_holding(BreaksOnRelease(), fails)
    assert [str(r.exc_value) for r in reported] == ["release failed"]
    with pytest.raises(RuntimeError, match="release failed"):
        _C.call_holding(BreaksOnRelease(), int)


class _MeddlingKey(str):
    """An instance-dict key that collides with "forward": its __eq__ runs Python in the
    middle of code_state_learn_forward's lookup, which drops the module's forward from
    its class and collects."""
    victim: Optional[type] = None

    def __hash__(self):
        return hash("forward")

    def __eq__(self, other):
        cls = type(self).victim
        if cls is not None and "forward" in cls.__dict__:
            type(self).victim = None
            del cls.forward
            gc.collect()
        return False


def test_python_in_the_middle_of_learning_a_forward():
    """Whatever point of the lookups the collision's __eq__ lands in (nn.Module's, the
    wrapper's, code_state_learn_forward's), compiled calls do what eager ones do."""
    def outcomes(compile_it):
        def run(self, x):
            return x * 4

        class Renamed(torch.nn.Module):
            forward = run

        model = Renamed()
        model.__dict__[_MeddlingKey("f")] = 1
        _MeddlingKey.victim = Renamed
        if compile_it:
            nnscaler.compile(model)
        seen = []
        x = torch.ones(2)
        for step in range(4):
            if step == 2:
                Renamed.forward = run
            try:
                seen.append(model(x).tolist())
            except (NotImplementedError, AttributeError) as exc:
                seen.append(type(exc).__name__)
        assert _MeddlingKey.victim is None   # the __eq__ did run
        return seen

    assert outcomes(True) == outcomes(False)


# ------------------------------------------ a call with no garbage collection, in C

def test_call_without_collections_pauses_them_for_the_call_only():
    seen = []

    def body(a, b=0):
        seen.append(gc.isenabled())
        return a + b

    assert gc.isenabled()
    assert _C.call_without_collections(body, 1, b=2) == 3
    assert seen == [False] and gc.isenabled()
    # Nested: the inner call leaves them paused for the outer one.
    assert _C.call_without_collections(_C.call_without_collections, gc.isenabled) is False
    assert gc.isenabled()
    with pytest.raises(TypeError, match="call_without_collections"):
        _C.call_without_collections()


def test_call_without_collections_resumes_on_every_exit_and_keeps_them_off_if_off():
    """Python in the middle: the call raises what a signal handler raises, collects
    explicitly (its finalizers run), switches collections on or off itself."""
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _C.call_without_collections(interrupted)
    assert gc.isenabled()

    collected = []

    class Cyclic:
        def __init__(self):
            self.me = self

        def __del__(self):
            collected.append(gc.isenabled())

    def collects():
        Cyclic()
        gc.collect()          # explicit: still collects, with collections paused
        return len(collected)

    assert _C.call_without_collections(collects) == 1 and collected == [False]
    # The call turns them off itself: on again after (they were on before); a call
    # that turns them on while they were off before: left as the call left them.
    assert _C.call_without_collections(gc.disable) is None and gc.isenabled()
    gc.disable()
    try:
        assert _C.call_without_collections(gc.isenabled) is False
        assert not gc.isenabled()
        _C.call_without_collections(gc.enable)
        assert gc.isenabled()
    finally:
        gc.enable()


def test_call_without_collections_with_a_finalizer_and_a_dropped_callable_in_the_middle():
    """Python in the middle that frees and mutates what the C path relies on: the
    callable drops every other reference to itself and to its argument, and a
    finalizer run inside turns collections back on (the path resumes them after
    whatever the call did)."""
    held = {}

    class TurnsThemOn:
        def __del__(self):
            gc.enable()

    class DropsItself:
        def __call__(self, arg, *, key):
            held.clear()                      # the call's own references remain
            TurnsThemOn()                     # freed at once: its __del__ runs here
            return gc.isenabled(), type(arg).__name__, key

    held["fn"], held["arg"] = DropsItself(), [1, 2]
    assert _C.call_without_collections(held["fn"], held["arg"], key=3) == (True, "list", 3)
    assert held == {} and gc.isenabled()
