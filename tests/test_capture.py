"""nnscaler.compile end to end: outputs equal eager, guards, recaptures, fallbacks."""
from __future__ import annotations

import os

import copy
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
import nnscaler_eval
from models import MLP, Block, Branchy, ConvBN, ValueOnly

TOL = dict(rtol=1e-5, atol=1e-6)


def pair(model: nn.Module):
    eager = copy.deepcopy(model)
    return eager, nnscaler.compile(model)


def same_seed_outputs(eager, compiled, *args, seed=123, **kwargs):
    torch.manual_seed(seed)
    a = eager(*args, **kwargs)
    torch.manual_seed(seed)
    b = compiled(*args, **kwargs)
    return a, b


@pytest.mark.parametrize("factory, shape", [(MLP, (4, 16)), (Block, (2, 8, 32)),
                                            (ConvBN, (2, 3, 8, 8))])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_outputs_equal_eager(factory, shape, mode):
    eager, model = pair(factory())
    getattr(eager, mode)()
    getattr(model, mode)()
    x = torch.randn(*shape)
    for _ in range(3):  # capture, then hits
        a, b = same_seed_outputs(eager, model, x)
        torch.testing.assert_close(a, b, **TOL)
    info = nnscaler.cache_info(model)
    assert info.captures >= 1 and info.hits >= 2


def test_dropout_masks_match_eager_in_train():
    eager, model = pair(Block(p=0.5).train())
    x = torch.randn(2, 8, 32)
    for _ in range(3):
        a, b = same_seed_outputs(eager, model, x, seed=7)
        torch.testing.assert_close(a, b, **TOL)


def test_batchnorm_running_stats_match_eager_after_training_steps():
    eager, model = pair(ConvBN().train())
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_m = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(4, 3, 8, 8)
        for m, opt in ((eager, opt_e), (model, opt_m)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for (n, a), (_, b) in zip(eager.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)
    assert nnscaler.cache_info(model).captures == 1  # optimizer steps: no recapture


def test_containers_and_shared_submodules():
    shared = nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.mlist = nn.ModuleList([shared, nn.ReLU(), shared])
            self.mdict = nn.ModuleDict({"a": nn.Linear(4, 4), "b": shared})

        def forward(self, x, scale=None, *, extra=None):
            for layer in self.mlist:
                x = layer(x)
            x = self.seq(x) + self.mdict["a"](x) + self.mdict["b"](x)
            if scale is not None:
                x = x * scale
            out = {"y": x, "pair": (x.sum(), x.mean())}
            if extra is not None:
                out["extra"] = extra + 1
            return out

    eager, model = pair(Net())
    x = torch.randn(3, 4)
    for kwargs in ({}, {"scale": 2.0}, {"extra": torch.ones(1)}, {"scale": None, "extra": None}):
        for _ in range(2):
            a, b = eager(x, **kwargs), model(x, **kwargs)
            torch.testing.assert_close(a, b, **TOL)
    assert nnscaler.cache_info(model).hits >= 4


def toggle_and_compare(eager, model, x, toggles: int) -> None:
    """Alternate eval()/train() on both models; outputs equal (same dropout seed)."""
    for i in range(toggles):
        mode = "train" if i % 2 else "eval"
        getattr(eager, mode)()
        getattr(model, mode)()
        a, b = same_seed_outputs(eager, model, x, seed=i)
        torch.testing.assert_close(a, b, **TOL)


def test_value_only_training_is_captured_once_across_100_toggles():
    eager, model = pair(ValueOnly())
    toggle_and_compare(eager, model, torch.randn(3, 4), 100)
    assert nnscaler.cache_info(model).captures == 1


def test_branching_on_training_is_captured_twice_across_100_toggles():
    eager, model = pair(Branchy())
    toggle_and_compare(eager, model, torch.randn(3, 4), 100)
    assert nnscaler.cache_info(model).captures == 2


def test_frozen_batchnorm_in_eval_inside_training_model():
    eager, model = pair(ConvBN().train())
    eager.bn1.eval()
    model.bn1.eval()
    x = torch.randn(4, 3, 8, 8)
    for _ in range(3):
        torch.testing.assert_close(eager(x), model(x), **TOL)
    torch.testing.assert_close(eager.bn2.running_mean, model.bn2.running_mean, **TOL)
    torch.testing.assert_close(eager.bn1.running_mean, model.bn1.running_mean, **TOL)


def test_forward_hook_added_later_runs_every_call_and_removal_restores():
    eager, model = pair(MLP())
    x = torch.randn(2, 16)
    model(x)
    seen = []

    def hook(mod, inp, out):
        seen.append(out.shape)
        return out * 0

    handles = [m.fc1.register_forward_hook(hook) for m in (eager, model)]
    for _ in range(3):
        torch.testing.assert_close(eager(x), model(x), **TOL)
    assert len(seen) == 6  # three eager calls, three compiled calls
    for h in handles:
        h.remove()
    torch.testing.assert_close(eager(x), model(x), **TOL)
    assert len(seen) == 6


def test_global_module_hook_runs_for_every_submodule_every_call():
    model = nnscaler.compile(MLP())
    x = torch.randn(2, 16)
    model(x)
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, inp, out: calls.append(type(mod).__name__))
    try:
        model(x)
        model(x)
    finally:
        handle.remove()
    assert calls.count("Linear") == 4 and calls.count("MLP") == 2


def test_skip_nnmodule_hook_guards_does_not_see_later_hooks():
    model = nnscaler.compile(MLP(), skip_nnmodule_hook_guards=True)
    x = torch.randn(2, 16)
    model(x)
    seen = []
    model.fc1.register_forward_hook(lambda *a: seen.append(1))
    model(x)
    assert seen == []  # documented: hook dicts are not guarded
    assert nnscaler.cache_info(model).captures == 1


def test_replacing_submodule_or_parameter_is_noticed():
    eager, model = pair(MLP())
    x = torch.randn(2, 16)
    model(x)
    new = nn.Linear(16, 32)
    eager.fc1 = copy.deepcopy(new)
    model.fc1 = new
    torch.testing.assert_close(eager(x), model(x), **TOL)
    p = nn.Parameter(torch.randn(16, 32))
    eager.fc2.weight = nn.Parameter(p.detach().clone())
    model.fc2.weight = p
    torch.testing.assert_close(eager(x), model(x), **TOL)
    assert nnscaler.cache_info(model).captures == 3


def test_gradients_equal_eager():
    eager, model = pair(Block().train())
    x = torch.randn(2, 8, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    for step in range(3):  # capture on the first step, hits after
        for m in (eager, model):
            m.zero_grad()
        x.grad = x2.grad = None
        a, b = same_seed_outputs(eager, model, x if step else x, seed=step)
        torch.manual_seed(step)
        b = model(x2)
        a.square().sum().backward()
        b.square().sum().backward()
        for (n, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    assert nnscaler.cache_info(model).hits >= 2


def test_shape_dtype_requires_grad_changes():
    model = nnscaler.compile(MLP())
    info = lambda: nnscaler.cache_info(model)  # noqa: E731
    model(torch.randn(2, 16))
    model(torch.randn(8, 16))
    assert info().captures == 2
    model(torch.randn(2, 16))
    assert info().captures == 2 and info().hits == 1
    model.double()
    model(torch.randn(2, 16, dtype=torch.float64))
    assert info().captures == 3
    model.float()
    model(torch.randn(2, 16, requires_grad=True))
    assert info().captures == 4


def test_cache_size_limit_four_with_ten_shapes():
    eager, model = pair(MLP())
    model = nnscaler.compile(model, cache_size_limit=4, dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 11):
            x = torch.randn(n, 16)
            torch.testing.assert_close(eager(x), model(x), **TOL)
    limit_warnings = [w for w in caught if "cache_size_limit" in str(w.message)]
    assert len(limit_warnings) == 1
    info = nnscaler.cache_info(model)
    assert info.captures == 4 and info.fallbacks == 6


class DataDependent(nn.Module):
    """Python reads a tensor's value (`.item()`): a graph break.  (An `if` on the
    tensor itself is a torch.cond now: tests/test_control_flow.py.)"""

    def __init__(self):
        super().__init__()
        self.inner = MLP(4)

    def forward(self, x):
        if x.sum().item() > 0:  # the line a fallback names
            return self.inner(x)
        return -self.inner(x)


def test_data_dependent_branch_falls_back_and_submodule_is_still_captured():
    eager, model = pair(DataDependent())
    pos, neg = torch.ones(2, 4), -torch.ones(2, 4)
    for x in (pos, neg, pos, neg):
        torch.testing.assert_close(eager(x), model(x), **TOL)
    # the root falls back (one capture attempt, then eager calls); its submodule's
    # forward is intercepted during those eager calls and captured on its own
    inner = nnscaler.cache_info(model.inner)
    assert nnscaler.cache_info(model).captures == inner.captures  # none for the root
    assert inner.captures >= 1 and inner.hits >= 1
    report = nnscaler.explain(model, pos)
    assert len(report.fallbacks) == 1
    fb = report.fallbacks[0]
    assert fb.filename == __file__ and "x.sum().item() > 0" in open(__file__).read().splitlines()[fb.lineno - 1]
    assert "data-dependent" in fb.reason


def test_fullgraph_raises_with_reason_and_location():
    model = nnscaler.compile(DataDependent(), fullgraph=True)
    with pytest.raises(Exception) as info:
        model(torch.ones(2, 4))
    assert "test_capture.py" in str(info.value)
    # the library stays usable
    ok = nnscaler.compile(MLP(4), fullgraph=True)
    ok(torch.ones(2, 4))


def test_exception_in_forward_names_user_line_and_next_call_works():
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.fail = True

        def forward(self, x):
            y = self.lin(x)
            return y @ torch.ones(5, 5) if self.fail else y  # shape error on purpose

    model = nnscaler.compile(Flaky())
    with pytest.raises(RuntimeError) as info:
        model(torch.ones(2, 4))
    entries = [(str(e.path), e.name) for e in info.traceback]
    assert (__file__, "forward") in entries
    # our own frames (convert_frame, tracer) are not in the user's traceback
    assert not any("nnscaler_eval" in path for path, _ in entries), entries
    model.fail = False
    assert model(torch.ones(2, 4)).shape == (2, 4)


def test_no_python_frame_of_this_project_on_a_hit():
    model = nnscaler.compile(MLP())
    x = torch.randn(2, 16)
    model(x)
    model(x)
    frames = []

    def profiler(frame, event, arg):
        if event == "call":
            frames.append(frame.f_code.co_filename)

    sys.setprofile(profiler)
    try:
        model(x)
    finally:
        sys.setprofile(None)
    package = os.path.dirname(os.path.abspath(nnscaler_eval.__file__))
    ours = [f for f in frames if f.startswith(package)]
    assert ours == [], ours
    assert nnscaler.cache_info(model).hits == 2


def test_generators_recursion_and_threads():
    model = nnscaler.compile(MLP(4))

    def gen():
        for i in range(3):
            yield model(torch.ones(i + 1, 4))

    assert [t.shape[0] for t in gen()] == [1, 2, 3]

    errors = []
    eager = copy.deepcopy(model)
    eager._compiled_call_impl = None

    def worker(k):
        try:
            for i in range(1000):
                x = torch.full((1 + (i + k) % 3, 4), float(k))
                torch.testing.assert_close(model(x), eager(x), **TOL)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]


def test_compile_plain_function_and_enable_capture_mode():
    @nnscaler.compile
    def f(x, y):
        return torch.sin(x) + y * 2

    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(f(x, 1.5), torch.sin(x) + 3.0)
    assert nnscaler.cache_info(f).captures == 1 and nnscaler.cache_info(f).hits == 2

    m = MLP(4)
    region = nnscaler.eval_frame.enable(backend="eager")   # its caches live as long as it
    for _ in range(2):
        with region:
            for _ in range(3):
                m(torch.ones(2, 4))
    assert nnscaler.cache_info(m).captures == 1 and nnscaler.cache_info(m).hits == 5


def test_explain_report():
    model = nnscaler.compile(Block().train())
    report = nnscaler.explain(model, torch.randn(2, 8, 32))
    text = str(report)
    assert len(report.graphs) == 1 and "scaled_dot_product_attention" in text
    assert "ifexpr" in text
    assert any("shape=(2, 8, 32)" in g for g in report.guards[0])
    assert report.fallbacks == []


def test_recapture_logs_name_the_guard(caplog):
    model = nnscaler.compile(MLP())
    with caplog.at_level("DEBUG", logger="nnscaler.recaptures"):
        model(torch.randn(2, 16))
        model(torch.randn(3, 16))
    assert any("(2, 16)" in r.message and "(3, 16)" in r.message for r in caplog.records)


def test_submodule_training_expression_is_a_graph_input_too():
    """A submodule's forward is inlined by the tracer; its `a if self.training else b`
    must still be rewritten (one graph for both modes, no branch guard)."""

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = 0.5

        def forward(self, x):
            return F.dropout(x, p=self.p if self.training else 0.0, training=self.training)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x) * 2

    eager, model = pair(Outer())
    toggle_and_compare(eager, model, torch.randn(4, 8), 10)
    assert nnscaler.cache_info(model).captures == 1


def _add_forward_hook(m, log):
    return m.register_forward_hook(lambda mod, args, out: (log.append("hook"), out + 100)[1])


def _add_pre_hook(m, log):
    return m.register_forward_pre_hook(lambda mod, args: (log.append("pre"), (args[0] * 3,))[1])


def _replace_hook_dict(m, log):
    from collections import OrderedDict
    m._forward_hooks = OrderedDict({12345: lambda mod, args, out: (log.append("dict"), out - 1)[1]})


def _store_into_hook_dict(m, log):
    m._forward_hooks[12345] = lambda mod, args, out: (log.append("store"), out - 2)[1]


def _global_hook(m, log):
    return torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: (log.append("global"), out + 5)[1] if mod is m else out)


def _instance_forward(m, log):
    m.forward = lambda x: (log.append("instance"), x * 7)[1]


def _class_forward(m, log):
    type(m).forward = lambda self, x: (log.append("class"), x * 9)[1]


def _class_swapped(m, log):
    m.__class__ = type("Swapped", (type(m),), {"forward": lambda self, x: (log.append("swap"), x - 4)[1]})


@pytest.mark.parametrize("change", [_add_forward_hook, _add_pre_hook, _replace_hook_dict,
                                    _store_into_hook_dict, _global_hook, _instance_forward,
                                    _class_forward, _class_swapped])
def test_the_root_call_path_follows_every_change_after_it_was_remembered(change):
    """The compiled root's call keeps its "no hooks, the class's own forward" decision
    under the versions of what it read (csrc/compiled_call.c, PlainCall): hooks added
    or swapped in any way, an instance or class `forward`, a new class: each is seen by
    the next call, as eager sees it."""
    def doubler() -> nn.Module:   # a class of its own per side: some changes are to it
        class Doubler(nn.Module):
            def forward(self, x):
                return x * 2
        return Doubler()

    eager, model = doubler(), nnscaler.compile(doubler())
    x = torch.ones(2)
    for _ in range(3):   # captured, then hits: the decision is kept
        torch.testing.assert_close(model(x), eager(x))
    eager_log: list[str] = []
    ours_log: list[str] = []
    handles = [change(eager, eager_log), change(model, ours_log)]
    try:
        for _ in range(3):
            torch.testing.assert_close(model(x), eager(x))
        assert ours_log == eager_log and len(ours_log) == 3
    finally:
        for h in handles:
            if h is not None:
                h.remove()
    if handles[0] is not None:   # removed: back to the plain path
        torch.testing.assert_close(model(x), eager(x))
        assert ours_log == eager_log and len(ours_log) == 3


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 2.0

    def forward(self, x, mask, flag):
        y = self.lin(x) * self.scale
        if mask is not None:
            y = y * mask
        y = F.dropout(y, p=0.5, training=self.training)
        return y + 1 if flag else y - 1


def test_positional_calls_answered_without_a_forward_frame_stay_equal_to_eager():
    """Calls with positional tensors, None and bools filling forward's parameters
    exactly are answered from the cache without making the forward's frame
    (csrc/compiled_call.c, call_forward).  Every kind of change still reaches them: the
    arguments' values and shapes, the training flag, an attribute the graph read, a
    hook, keywords (the frame path), and an error in the graph."""
    eager, model = pair(Gated())
    x, mask = torch.randn(3, 4), torch.rand(3, 4)
    calls = [(x, None, True), (x, mask, False), (x, None, False), (torch.randn(5, 4), mask[:1], True)]
    for mode in ("train", "eval", "train"):
        getattr(eager, mode)()
        getattr(model, mode)()
        for args in calls * 2:
            a, b = same_seed_outputs(eager, model, *args)
            torch.testing.assert_close(a, b, **TOL)
    hits = nnscaler.cache_info(model).hits
    assert hits >= 12
    for m in (eager, model):
        m.scale = 3.0
    a, b = same_seed_outputs(eager, model, x, mask, True)
    torch.testing.assert_close(a, b, **TOL)
    a, b = same_seed_outputs(eager, model, x, mask=mask, flag=True)   # keywords
    torch.testing.assert_close(a, b, **TOL)
    seen = []
    for m in (eager, model):
        m.register_forward_hook(lambda mod, args, out: seen.append(1))
    a, b = same_seed_outputs(eager, model, x, None, True)
    torch.testing.assert_close(a, b, **TOL)
    assert seen == [1, 1]
    with pytest.raises(RuntimeError) as e_eager:
        eager(torch.randn(3, 5), None, True)
    with pytest.raises(RuntimeError) as e_ours:
        model(torch.randn(3, 5), None, True)
    assert str(e_ours.value) == str(e_eager.value)
    model(x, None, True)   # still usable
    assert nnscaler.cache_info(model).hits > hits
