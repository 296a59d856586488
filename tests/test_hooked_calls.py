"""A hooked submodule at hit time (csrc/hooked_call.c, `_C.call_hooked`; autograd
Functions and register_op ops are called disarmed through `_C.call_disarmed`): its hooks run with the
evaluator out of the way, its forward armed and served from its own cache, and
everything nn.Module.__call__ does with hooks is what eager does: eager is the oracle
for every kind of hook, their results, their order, always_call on errors."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn as nn

import nnscaler
from nnscaler_eval import _C


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fail = False

    def forward(self, x, scale=1.0):
        if self.fail:
            raise ValueError("forward failed")
        return self.lin(x) * scale


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.post = nn.Linear(8, 8)

    def forward(self, x):
        return self.post(self.inner(x, scale=2.0)) + 1


def twins(cls=Outer):
    """Two instances of `cls` with the same parameters: eager's, and ours."""
    torch.manual_seed(0)
    eager = cls()
    torch.manual_seed(0)
    return eager, cls()


def pair():
    eager, model = twins()
    return eager, model, nnscaler.compile(model)


def run_both(eager, compiled, calls=3, shape=(2, 8)):
    """Outputs of eager and compiled for the same inputs, over several calls (the
    first captures, the others hit)."""
    outs = []
    for i in range(calls):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            outs.append((eager(x), compiled(x)))
    return outs


def assert_same(outs):
    for want, got in outs:
        assert torch.equal(want, got)


def test_hooks_run_without_the_evaluator_and_the_forward_hits_its_own_cache():
    eager, model, compiled = pair()
    seen = []

    def hook(module, args, out):
        seen.append(_C.eval_frame_installed())
        return out * 3

    eager.inner.register_forward_hook(hook)
    model.inner.register_forward_hook(hook)
    assert_same(run_both(eager, compiled, calls=4))
    # eager, then the capture's own run, then hits: the hooks of hits run disarmed
    assert seen[-2:] == [False, False]
    # the root, and the hooked submodule's forward on its own (cache_info counts both)
    assert nnscaler.cache_info(model).captures == 2
    assert nnscaler.cache_info(model.inner).hits >= 2
    assert not _C.eval_frame_installed()


@pytest.mark.parametrize("kind", ["none", "value", "tuple", "kwargs", "kwargs_none"])
def test_pre_hooks_of_every_kind_equal_eager(kind):
    eager, model, compiled = pair()

    def hook(module, args, *rest):
        if kind == "none":
            return None
        if kind == "value":
            return args[0] + 1
        if kind == "tuple":
            return (args[0] * 2,)
        if kind == "kwargs":
            (kwargs,) = rest
            return (args[0] - 1,), dict(kwargs, scale=0.5)
        return None

    with_kwargs = kind.startswith("kwargs")
    for m in (eager, model):
        m.inner.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
    assert_same(run_both(eager, compiled))


def test_a_pre_hook_returning_a_bad_pair_raises_as_eager_does():
    eager, model, compiled = pair()

    def hook(module, args, kwargs):
        return "not a pair"

    x = torch.randn(2, 8)
    model.inner.register_forward_pre_hook(hook, with_kwargs=True)
    with pytest.raises(RuntimeError, match="forward pre-hook must return None or a tuple"):
        compiled(x)
    with pytest.raises(RuntimeError, match="forward pre-hook must return None or a tuple"):
        compiled(x)
    assert not _C.eval_frame_installed()


def test_forward_hooks_with_and_without_kwargs_and_global_hooks_in_eager_order():
    eager, model, compiled = pair()
    logs: dict[int, list] = {id(eager): [], id(model): []}

    def root_of(module):
        return id(eager) if any(module is m for m in eager.modules()) else id(model)

    def plain(module, args, out):
        logs[root_of(module)].append(("plain", type(module).__name__))
        return out + 1

    def with_kwargs(module, args, kwargs, out):
        logs[root_of(module)].append(("kwargs", dict(kwargs)))
        return None

    def first(module, args, out):
        logs[root_of(module)].append(("first", type(module).__name__))

    def global_pre(module, args):
        if type(module) is Inner:
            logs[root_of(module)].append(("global pre", type(module).__name__))

    for m in (eager, model):
        m.inner.register_forward_hook(plain)
        m.inner.register_forward_hook(with_kwargs, with_kwargs=True)
        m.inner.register_forward_hook(first, prepend=True)
    handle = nn.modules.module.register_module_forward_pre_hook(global_pre)
    try:
        assert_same(run_both(eager, compiled))
    finally:
        handle.remove()
    assert logs[id(model)] == logs[id(eager)]
    assert ("kwargs", {"scale": 2.0}) in logs[id(model)]


@pytest.mark.parametrize("where", ["forward", "hook", "pre-hook"])
def test_always_call_hooks_run_when_forward_or_a_hook_raises(where):
    eager, model, compiled = pair()
    logs: dict[int, list] = {}
    state = {"fail": False}

    def always(module, args, out):
        logs[id(module)].append(("always", out is None))
        return out

    def bad(module, args, *rest):
        if state["fail"]:
            raise KeyError("hook failed")

    def failing_always(module, args, out):
        if state["fail"]:
            raise OSError("silenced")

    x = torch.randn(2, 8)
    for m in (eager, model):
        logs[id(m.inner)] = []
        if where == "hook":
            m.inner.register_forward_hook(bad)
        if where == "pre-hook":
            m.inner.register_forward_pre_hook(bad)
        m.inner.register_forward_hook(always, always_call=True)
        m.inner.register_forward_hook(failing_always, always_call=True)
    assert_same(run_both(eager, compiled))  # a capture, then hits, nothing failing
    state["fail"] = True
    for m in (eager.inner, model.inner):
        m.fail = where == "forward"
        logs[id(m)].clear()
    expected = KeyError if where != "forward" else ValueError
    for m in (eager, compiled):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(expected), torch.no_grad():
                m(x)
        assert any("always_call=True" in str(w.message) for w in caught)
    assert logs[id(model.inner)] == logs[id(eager.inner)] != []
    assert not _C.eval_frame_installed()
    state["fail"] = False
    for m in (eager.inner, model.inner):
        m.fail = False
    assert_same(run_both(eager, compiled, calls=2))


def test_hooks_calling_modules_plain_and_compiled_equal_eager():
    eager, model, compiled = pair()
    torch.manual_seed(1)
    side = nn.Linear(8, 8)
    compiled_side = nnscaler.compile(nn.Linear(8, 8))
    compiled_side.load_state_dict(side.state_dict())

    def hook(module, args, out):
        return side(out) + compiled_side(out)

    eager.inner.register_forward_hook(hook)
    model.inner.register_forward_hook(hook)
    assert_same(run_both(eager, compiled, calls=4))
    # a compiled module arms itself, disarmed region or not
    assert nnscaler.cache_info(compiled_side).hits >= 2


def test_hooks_changing_hooks_while_they_run_see_what_eager_sees():
    eager, model, compiled = pair()
    logs: dict[int, list] = {id(eager.inner): [], id(model.inner): []}

    def late(module, args, out):
        logs[id(module)].append("late")

    def adding(module, args, out):
        logs[id(module)].append("adding")
        handle = module.register_forward_hook(late)
        handle.remove()  # nn.Module iterates over a copy: neither runs it now

    for m in (eager.inner, model.inner):
        m.register_forward_hook(adding)
    assert_same(run_both(eager, compiled))
    assert logs[id(model.inner)] == logs[id(eager.inner)] == ["adding"] * 3


def test_backward_hooks_keep_the_modules_own_call():
    logs = []

    def backward_hook(module, grad_in, grad_out):
        logs.append(tuple(g.shape for g in grad_out))

    def forward_hook(module, args, out):
        return out * 2

    eager, model = twins()
    for m in (eager, model):
        m.inner.register_full_backward_hook(backward_hook)
        m.inner.register_forward_hook(forward_hook)
    compiled = nnscaler.compile(model)
    for i in range(3):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
        want = eager(x)
        want.sum().backward()
        got = compiled(x)
        got.sum().backward()
        assert torch.equal(want, got)
    assert len(logs) == 6 and len(set(logs)) == 1
    for a, b in zip(eager.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_nested_hooked_modules_and_enable_inside_a_hook():
    class Mid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x) + 2

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mid = Mid()

        def forward(self, x):
            return self.mid(x) * 3

    seen = []

    def inner_hook(module, args, out):
        seen.append(("inner", _C.current_config() is not None))
        return out - 1

    def mid_hook(module, args, out):
        seen.append(("mid", _C.current_config() is not None))
        with nnscaler.eval_frame.enable():
            seen.append(("enabled", _C.current_config() is not None))
        return out

    eager, model = twins(Top)
    for m in (eager, model):
        m.mid.register_forward_hook(mid_hook)
        m.mid.inner.register_forward_hook(inner_hook)
    compiled = nnscaler.compile(model)
    assert_same(run_both(eager, compiled, calls=4))
    seen.clear()
    with torch.no_grad():
        compiled(torch.ones(2, 8))  # a hit of every graph
    assert seen == [("inner", False), ("mid", False), ("enabled", True)]
    assert not _C.eval_frame_installed() and _C.current_config() is None


def test_call_disarmed_and_call_hooked_outside_regions_are_plain_calls():
    assert _C.call_disarmed(lambda a, b=0: a + b, 1, b=2) == 3
    assert _C.call_disarmed(lambda: _C.current_config()) is None
    eager, model = twins()
    for m in (eager, model):
        m.inner.register_forward_hook(lambda module, args, out: out * 5)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(_C.call_hooked(model.inner, (x,), {"scale": 3.0}),
                           eager.inner(x, scale=3.0))
    with pytest.raises(TypeError, match="fn missing"):
        _C.call_disarmed()
    with pytest.raises(TypeError, match=r"call_hooked\(module, args tuple, kwargs dict\)"):
        _C.call_hooked(model.inner, [x], {})
    with pytest.raises(ZeroDivisionError):
        _C.call_disarmed(lambda: 1 / 0)
    assert not _C.eval_frame_installed()


def test_an_interrupt_in_a_hook_leaves_nothing_armed():
    eager, model, compiled = pair()
    state = {"raise": False}

    def hook(module, args, out):
        if state["raise"]:
            raise KeyboardInterrupt
        return out

    eager.inner.register_forward_hook(hook)
    model.inner.register_forward_hook(hook)
    assert_same(run_both(eager, compiled))
    state["raise"] = True
    with pytest.raises(KeyboardInterrupt):
        compiled(torch.randn(2, 8))
    assert not _C.eval_frame_installed() and _C.current_config() is None
    state["raise"] = False
    assert_same(run_both(eager, compiled))


def test_a_thread_in_a_disarmed_hook_leaves_other_threads_armed():
    """Thread A waits inside a hook (nothing armed there, the evaluator needed by B
    only); B's compiled calls capture and hit meanwhile; then A goes on."""
    eager, model, compiled = pair()
    inside, release = threading.Event(), threading.Event()
    state = {"wait": False}

    def hook(module, args, out):
        if state["wait"]:
            inside.set()
            assert release.wait(30)
        return out

    model.inner.register_forward_hook(hook)
    eager.inner.register_forward_hook(hook)
    assert_same(run_both(eager, compiled))
    state["wait"] = True
    results = {}

    def thread_a():
        with torch.no_grad():
            results["a"] = compiled(torch.ones(2, 8))

    t = threading.Thread(target=thread_a)
    t.start()
    try:
        assert inside.wait(30)
        state["wait"] = False
        other = nnscaler.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
        with torch.no_grad():
            for _ in range(3):
                y = other(torch.ones(3, 8))
        assert torch.equal(y, other[1](other[0](torch.ones(3, 8))))
        assert nnscaler.cache_info(other).hits == 2
    finally:
        release.set()
        t.join(30)
    with torch.no_grad():
        assert torch.equal(results["a"], eager(torch.ones(2, 8)))
    assert not _C.eval_frame_installed()


def graph_as_is(gm, example_inputs):
    return gm


@pytest.mark.parametrize("backend", ["eager", graph_as_is])
@pytest.mark.parametrize("opaque_by", ["hook", "compiled on its own", "hook, own _call_impl"])
def test_a_class_wrapping_super_call_is_applied_once(opaque_by, backend):
    """The graph node of an opaque submodule stands for nn.Module.__call__: the
    class's own __call__ around super().__call__() was traced around it, and must
    not run a second time at hit time (it did: a silent wrong result)."""

    class Wrapping(Inner):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs) - 5

    class OwnImpl(Wrapping):
        def _call_impl(self, *args, **kwargs):
            return super()._call_impl(*args, **kwargs) * 1

    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = (OwnImpl if "own" in opaque_by else Wrapping)()

        def forward(self, x):
            return self.inner(x) * 3

    torch.manual_seed(0)
    host = Host()
    if "hook" in opaque_by:
        host.inner.register_forward_hook(lambda module, args, out: out * 2)
    else:
        nnscaler.compile(host.inner)
    x = torch.ones(2, 8)
    with torch.no_grad():
        want = host(x)
        compiled = nnscaler.compile(host, backend=backend)
        for _ in range(3):
            assert torch.equal(compiled(x), want)
    assert nnscaler.cache_info(host).hits >= 2


def test_under_enable_the_split_call_equals_eager():
    """Under enable("eager") (a context region, not a compiled call) the disarmed region
    cannot take the context's count: the evaluator stays installed, frames in hooks
    run with nothing armed, and the forward is armed again for its own cache."""
    eager, model = twins()
    seen = []

    def hook(module, args, out):
        seen.append(_C.current_config() is None)
        return out - 2

    eager.inner.register_forward_hook(hook)
    model.inner.register_forward_hook(hook)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
            want = eager(x)
            with nnscaler.eval_frame.enable("eager"):
                got = model(x)
            assert torch.equal(want, got)
    assert nnscaler.cache_info(model).hits >= 2
    assert seen[-1] is True
    assert not _C.eval_frame_installed()


def test_a_compiled_module_inside_another_splits_its_hooked_submodule():
    """A module compiled on its own, first called inside another module's capture
    (an opaque node there): its own hits run its hooked submodule's hooks disarmed,
    and both graphs equal eager."""
    eager, model = twins()
    seen = []

    def hook(module, args, out):
        seen.append(_C.current_config() is None)
        return out + 3

    eager.inner.register_forward_hook(hook)
    model.inner.register_forward_hook(hook)
    nnscaler.compile(model)

    class Host(nn.Module):
        def __init__(self, child):
            super().__init__()
            self.child = child

        def forward(self, x):
            return self.child(x) * 2

    host = nnscaler.compile(Host(model))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
            assert torch.equal(host(x), eager(x) * 2)
    assert seen[-1] is True
    assert nnscaler.cache_info(model).hits >= 2


def test_an_autograd_function_runs_disarmed_and_keeps_its_backward():
    seen = []

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            seen.append(_C.current_config() is None)
            return a * 4

        @staticmethod
        def backward(ctx, grad):
            return grad * 3

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return Scaled.apply(self.fc(x)) + 1

    eager, model = twins(Net)
    compiled = nnscaler.compile(model)
    for i in range(3):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
        want, got = eager(x), compiled(x)
        assert torch.equal(want, got)
        want.sum().backward()
        got.sum().backward()
    assert seen[-1] is True
    assert nnscaler.cache_info(model).hits == 2
    for a, b in zip(eager.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_python_in_the_middle_of_call_hooked_frees_and_mutates_what_it_holds():
    """Python run inside each step of _C.call_hooked (csrc/hooked_call.c) drops what
    the call and its regions hold: a __del__ run when a pre-hook's new args replace
    the old ones resets every cache and removes the hooks being iterated; a
    __getattribute__ on the hooked module deletes the root's compiled wrapper when the
    forward hooks are read; a tensor subclass's __torch_function__ inside the resumed
    forward collects garbage.  Every call equals eager's, and nothing is left armed."""
    import gc

    state = {"on": False, "wrapper_dropped": 0}
    roots: list = []

    class Dropper:
        def __del__(self):
            if state["on"]:
                nnscaler.reset()
                for root in roots:
                    root.inner._forward_pre_hooks.clear()
                gc.collect()

    class Meddling(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if state["on"]:
                gc.collect()
            return super().__torch_function__(func, types, args, kwargs or {})

    class Watched(Inner):
        def __getattribute__(self, name):
            if name == "_forward_hooks" and state["on"] and roots and \
                    roots[-1].__dict__.get("_compiled_call_impl") is not None:
                roots[-1]._compiled_call_impl = None
                state["wrapper_dropped"] += 1
                gc.collect()
            return super().__getattribute__(name)

        def forward(self, x, scale=1.0):
            return super().forward(x.as_subclass(Meddling), scale).as_subclass(torch.Tensor)

    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Watched()

        def forward(self, x):
            return self.inner(x) * 2

    def add_dropper(module, args):
        return (args[0], Dropper())

    def drop_it(module, args):
        return (args[0],)

    def post(module, args, out):
        return out + 1

    eager, model = twins(Host)
    roots.append(model)
    for m in (eager, model):
        m.inner.register_forward_pre_hook(add_dropper)
        m.inner.register_forward_pre_hook(drop_it)
        m.inner.register_forward_hook(post)
    nnscaler.compile(model)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), eager(x))  # a capture, then hits
        state["on"] = True
        got = model(x)          # a hit whose Python meddles at each step
        state["on"] = False
        for m in (eager,):      # the same pre-hooks, cleared on the eager side too
            m.inner._forward_pre_hooks.clear()
        want = eager(x)
        # the first pre-hook's Dropper died in the second: eager's result then
        assert torch.equal(got, want)
        assert state["wrapper_dropped"] == 1
        for _ in range(2):     # the model, recompiled, captures again and hits
            nnscaler.compile(model)
            assert torch.equal(model(x), eager(x))
    assert not _C.eval_frame_installed() and _C.current_config() is None


@pytest.mark.parametrize("with_kwargs", [False, True])
def test_global_forward_hooks_equal_eager(with_kwargs):
    """Only a global forward hook (the module's own registries empty): read from
    torch.nn.modules.module, with its with_kwargs companion."""
    eager, model, compiled = pair()
    logs: list = []

    def hook(module, args, *rest):
        out = rest[-1]
        if type(module) is Inner:
            logs.append((type(module).__name__, len(rest)))
            return out * 7
        return None

    handle = nn.modules.module.register_module_forward_hook(hook, with_kwargs=with_kwargs)
    try:
        assert_same(run_both(eager, compiled))
    finally:
        handle.remove()
    assert len(logs) == 6 and len(set(logs)) == 1
    assert_same(run_both(eager, compiled, calls=2))


def test_a_removed_global_hook_leaves_submodules_inlined():
    """torch leaves a removed global hook's with_kwargs mark in
    _global_forward_hooks_with_kwargs; _call_impl ignores it (no hook in the main
    registries), so must we: submodules are inlined again, not opaque nodes."""
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, kwargs, out: None, with_kwargs=True)
    handle.remove()
    eager, model, compiled = pair()
    assert_same(run_both(eager, compiled))
    # one graph for the root, no capture of Inner.forward on its own
    assert nnscaler.cache_info(model).captures == 1
    assert nnscaler.cache_info(model.inner).captures == 0
