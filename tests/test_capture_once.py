"""Captured whole, captured once: the shapes of real code that used to capture again on
every call, or not at all (issue 18).  Eager is the oracle; capture counts are asserted.
"""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from oracle import assert_same


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _twins(cls, **options):
    eager = cls()
    ours = cls()
    ours.load_state_dict(eager.state_dict())
    return eager, nnscaler.compile(ours, **options)


# ------------------------------------------------ regions: caches outlive the block

def test_region_blocks_share_one_capture():
    model, x = TwoLayers(), torch.randn(2, 4)
    expected = model(x)
    for _ in range(20):
        with nnscaler.eval_frame.enable(backend="eager"):
            out = model(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    info = nnscaler.cache_info(model)
    assert info.captures == 1 and info.hits == 19 and info.entries == 1, info


def test_region_decorator_and_equal_options_share_caches():
    model, x = TwoLayers(), torch.randn(2, 4)

    @nnscaler.eval_frame.enable(backend="eager", cache_size_limit=8)
    def step():
        return model(x)

    step()
    with nnscaler.eval_frame.enable(backend="eager"):   # the same options, spelled out less
        model(x)
    step()
    assert nnscaler.cache_info(model).captures == 1
    # other options are another configuration: a capture of their own
    with nnscaler.eval_frame.enable(backend="eager", fullgraph=True):
        model(x)
    assert nnscaler.cache_info(model).captures == 2


def test_region_backend_callables_by_identity():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    model, x = TwoLayers(), torch.randn(2, 4)
    for _ in range(3):
        with nnscaler.eval_frame.enable(backend=backend):
            model(x)
    assert len(calls) == 1

    def other(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    with nnscaler.eval_frame.enable(backend=other):
        model(x)
    assert len(calls) == 2


def test_region_caches_die_with_their_module():
    model, x = TwoLayers(), torch.randn(2, 4)
    with nnscaler.eval_frame.enable(backend="eager"):
        model(x)
        model(x)
    assert nnscaler.cache_info(model).hits == 1
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_region_caches_do_not_travel_with_copies():
    import copy
    import io
    model, x = TwoLayers(), torch.randn(2, 4)
    with nnscaler.eval_frame.enable(backend="eager"):
        model(x)
    for twin in (copy.deepcopy(model), copy.copy(model)):
        with nnscaler.eval_frame.enable(backend="eager"):
            torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with nnscaler.eval_frame.enable(backend="eager"):
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
        loaded(x)
    assert nnscaler.cache_info(loaded).hits >= 1
    assert set(model.state_dict()) == {"a.weight", "a.bias", "b.weight", "b.bias"}


def test_region_state_change_between_blocks_recaptures():
    model, x = TwoLayers(), torch.randn(2, 4)
    with nnscaler.eval_frame.enable(backend="eager"):
        model(x)
    model.b = nn.Identity()
    with nnscaler.eval_frame.enable(backend="eager"):
        out = model(x)
    torch.testing.assert_close(out, torch.relu(model.a(x)), rtol=0, atol=0)


# ------------------------------------------------ modules built during forward

class BuildsSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.dim = -1

    def forward(self, x):
        return nn.Softmax(dim=self.dim)(self.proj(x))


def test_module_built_in_forward_hits():
    model, x = BuildsSoftmax(), torch.randn(3, 4)
    expected = model(x)
    nnscaler.compile(model)
    for _ in range(4):
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    info = nnscaler.cache_info(model)
    assert info.captures == 1 and info.hits == 3, info
    # what built it is still guarded: another dim is another graph
    model.dim = 0
    torch.testing.assert_close(model(x), torch.softmax(model.proj(x), dim=0), rtol=0, atol=0)
    assert nnscaler.cache_info(model).captures == 2


class BuildsActivationByName(nn.Module):
    """Hugging Face's ACT2FN[name]: a new activation module per lookup."""
    TABLE = {"gelu": nn.GELU, "silu": nn.SiLU}

    def __init__(self, act: str) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = act

    def forward(self, x):
        return self.TABLE[self.act]()(self.proj(x))


def test_activation_built_per_call_follows_its_name():
    model, x = BuildsActivationByName("gelu"), torch.randn(2, 4)
    nnscaler.compile(model)
    for _ in range(3):
        torch.testing.assert_close(model(x), F.gelu(model.proj(x)), rtol=0, atol=0)
    assert nnscaler.cache_info(model).captures == 1
    model.act = "silu"
    torch.testing.assert_close(model(x), F.silu(model.proj(x)), rtol=0, atol=0)
    BuildsActivationByName.TABLE["silu"] = nn.Tanh   # the class the table names
    try:
        torch.testing.assert_close(model(x), torch.tanh(model.proj(x)), rtol=0, atol=0)
    finally:
        BuildsActivationByName.TABLE["silu"] = nn.SiLU


class BuildsDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        # a new Dropout is in training mode whatever this module's mode is
        return nn.Dropout(0.5)(self.proj(x))


def test_built_module_keeps_its_own_training_flag():
    model, x = BuildsDropout().eval(), torch.randn(4, 8)
    torch.manual_seed(1)
    expected = model(x)
    nnscaler.compile(model)
    for _ in range(3):
        torch.manual_seed(1)
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert nnscaler.cache_info(model).captures == 1


class BuildsLinear(nn.Module):
    def forward(self, x):
        return nn.Linear(4, 4)(x)   # new random weights on every call


def test_module_with_tensors_built_in_forward_stays_eager_equal():
    model, x = BuildsLinear(), torch.randn(2, 4)
    torch.manual_seed(3)
    expected = [model(x) for _ in range(3)]
    nnscaler.compile(model)
    torch.manual_seed(3)
    got = [model(x) for _ in range(3)]
    assert_same(got, expected)


class BuildsLoss(nn.Module):
    """Hugging Face's classification heads: `CrossEntropyLoss()` built per call; its
    `weight` buffer slot is registered as None (it holds no tensor)."""

    def __init__(self, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.weight = weight

    def forward(self, x, labels):
        return nn.CrossEntropyLoss(weight=self.weight)(self.proj(x), labels)


def test_loss_module_built_per_call_hits():
    model = BuildsLoss()
    assert list(nn.CrossEntropyLoss()._buffers.items()) == [("weight", None)]
    eager = copy.deepcopy(model)
    nnscaler.compile(model)
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x, labels = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
        torch.testing.assert_close(model(x, labels), eager(x, labels), rtol=0, atol=0)
    info = nnscaler.cache_info(model)
    assert info.captures == 1 and info.hits == 3, info
    # one built around a tensor of the caller's holds it: still eager's answers
    weighted, weights = BuildsLoss(torch.tensor([1.0, 2.0, 3.0])), []
    reference = copy.deepcopy(weighted)
    nnscaler.compile(weighted)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x, labels = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
        weights.append(weighted(x, labels))
        torch.testing.assert_close(weights[-1], reference(x, labels), rtol=0, atol=0)
        weighted.weight.mul_(2.0)
        reference.weight.mul_(2.0)


# ------------------------------------------------ forwards under another name

def _scaled(self, x):
    return self.proj(x) * self.scale


class ForwardAssigned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = 2.0

    forward = _scaled


class ForwardBoundOnInstance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = 3.0
        self.forward = self.run

    def run(self, x):
        return self.proj(x) * self.scale


@pytest.mark.parametrize("cls", [ForwardAssigned, ForwardBoundOnInstance])
def test_forward_under_another_name_is_captured(cls):
    model, x = cls(), torch.randn(2, 4)
    nnscaler.compile(model)
    for _ in range(3):
        torch.testing.assert_close(model(x), model.proj(x) * model.scale, rtol=0, atol=0)
    report = nnscaler.explain(model, x)
    # the root's own code is the graph (the Linear inlined), not the Linear alone
    assert len(report.graphs) == 1 and "mul" in report.graphs[0].code, str(report)
    model.scale = 5.0
    torch.testing.assert_close(model(x), model.proj(x) * 5.0, rtol=0, atol=0)


def test_forward_under_another_name_in_a_region():
    model, x = ForwardAssigned(), torch.randn(2, 4)
    for _ in range(3):
        with nnscaler.eval_frame.enable(backend="eager"):
            model(x)
    info = nnscaler.cache_info(model)
    assert info.captures == 1 and info.hits == 2, info


# ------------------------------------------------ counters

class CountsItsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.n = 0

    def forward(self, x):
        self.n = self.n + 1
        self.seen = [self.n]     # a list: not a plain value a runner could write again
        return self.proj(x) * self.n


def test_calls_run_eagerly_count_as_fallbacks():
    """A write of a new list each call: each call runs eagerly (through its trace,
    which falls back), and each counts as a fallback, not only as a miss."""
    eager, ours = _twins(CountsItsCalls)
    x = torch.randn(2, 4)
    for _ in range(4):
        torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
    assert ours.n == eager.n == 4 and ours.seen == eager.seen == [4]
    info = nnscaler.cache_info(ours)
    assert info.fallbacks == 4 and info.hits == 0, info


# ------------------------------------------------ in-place edits of reachable state

CALLS_SEEN: list = []


class AppendsToGlobal(nn.Module):
    def forward(self, x):
        CALLS_SEEN.append(x.shape[0])
        return x * 2


def _closure_model():
    seen: dict = {}

    class CountsInClosure(nn.Module):
        def forward(self, x):
            seen[len(seen)] = True
            return x + 1

    return CountsInClosure(), seen


def test_in_place_edit_of_a_global_list_is_not_lost():
    CALLS_SEEN.clear()
    model, x = nnscaler.compile(AppendsToGlobal()), torch.ones(2)
    for _ in range(3):
        torch.testing.assert_close(model(x), x * 2)
    assert CALLS_SEEN == [2, 2, 2]
    assert nnscaler.cache_info(model).fallbacks == 3


def test_in_place_edit_of_a_closure_dict_is_not_lost():
    model, seen = _closure_model()
    nnscaler.compile(model)
    for _ in range(3):
        model(torch.ones(2))
    assert len(seen) == 3


def test_each_distinct_backend_failure_warns():
    def make_failing(message):
        def backend(gm, example_inputs):   # two backends, one name
            raise RuntimeError(message)
        return backend

    x = torch.randn(2, 4)
    for message in ("first backend broke", "second backend broke"):
        model = TwoLayers()
        expected = model(x)
        nnscaler.compile(model, backend=make_failing(message))
        with pytest.warns(RuntimeWarning, match=message):
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


# ------------------------------------------------ inputs that are module state

class AddsItsBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("pos", torch.randn(2, 4))

    def forward(self, x):
        return self.proj(x) + self.pos * 2


def test_buffer_passed_as_input_is_cached():
    eager, ours = _twins(AddsItsBuffer)
    for _ in range(3):
        torch.testing.assert_close(ours(ours.pos), eager(eager.pos), rtol=0, atol=0)
    info = nnscaler.cache_info(ours)
    assert info.captures == 1 and info.hits == 2, info
    other = torch.randn(2, 4)   # the graph does not take the input for the buffer
    torch.testing.assert_close(ours(other), eager(other), rtol=0, atol=0)
    assert nnscaler.cache_info(ours).captures == 1


def test_parameter_passed_as_input_gets_both_gradients():
    eager, ours = _twins(AddsItsBuffer)
    for model in (eager, ours):
        for _ in range(3):
            model(model.proj.weight[:2].detach().requires_grad_()).sum().backward()
            model(model.pos).sum().backward()
    torch.testing.assert_close(ours.proj.weight.grad, eager.proj.weight.grad)

    class TakesItsWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            return (x @ self.w).sum()

    eager, ours = _twins(TakesItsWeight)
    for model in (eager, ours):
        for _ in range(3):
            model(model.w).backward()
    torch.testing.assert_close(ours.w.grad, eager.w.grad)
    assert nnscaler.cache_info(ours).captures == 1


class ScalesInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.ones(3))

    def forward(self, x):
        x.mul_(2)
        return x + self.state


def test_in_place_on_an_input_that_is_a_buffer():
    eager, ours = _twins(ScalesInPlace)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(ours(ours.state), eager(eager.state), rtol=0, atol=0)
    torch.testing.assert_close(ours.state, eager.state, rtol=0, atol=0)
    assert nnscaler.cache_info(ours).captures == 1


# ------------------------------------------------ gradient checkpointing

class BranchesOnCompiling(nn.Module):
    """HF's MoE layers: one path when compiled, a data-dependent shortcut eagerly;
    the two save different tensors for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        if torch.compiler.is_compiling():
            return torch.relu(self.a(x)) + self.b(x)
        h = self.a(x)
        if (h > 100).any():
            return h
        return h.sigmoid() * 0 + torch.relu(h) + self.b(x)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner = BranchesOnCompiling()
        self.reentrant = reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x,
                                                 use_reentrant=self.reentrant).sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_module_recomputes_the_path_it_took(reentrant):
    eager, ours = _twins(lambda: Checkpointed(reentrant))
    x = torch.randn(2, 4, requires_grad=True)
    for model in (eager, ours):
        for _ in range(3):
            model(x).backward()     # CheckpointError here before
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, dict(eager.named_parameters())[name].grad)


# ------------------------------------------------ recaptures leave nothing behind

class BranchesOnMode(TwoLayers):
    def forward(self, x):
        h = self.a(x)
        if self.training:
            h = h * 2
        return self.b(h)


def test_entries_of_removed_hooks_are_dropped():
    """A new hook function per step, added and removed, and the mode toggled: each
    entry made while a hook was in can never hold again once its function is freed;
    it leaves the bucket instead of filling cache_size_limit (default 8)."""
    eager, ours = _twins(BranchesOnMode)
    x = torch.randn(2, 4)
    for _ in range(30):
        outs = []
        for model in (eager, ours):
            handle = model.a.register_forward_hook(lambda mod, inputs, out: out + 1)
            outs.append(model(x))
            model.train(not model.training)
            outs.append(model(x))
            handle.remove()
            outs.append(model(x))
        assert_same(outs[3:], outs[:3])
    gc.collect()
    info = nnscaler.cache_info(ours)
    assert info.fallbacks == 0 and info.entries <= 4, info


# ------------------------------------------------ state an earlier eager call cached

class CachesItsBias(nn.Module):
    """timm's levit / efficientformer: in eval, a bias computed from parameters is
    cached in a dict attribute by the first call, and read by the later ones."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4))
        self.proj = nn.Linear(4, 4)
        self.cache: dict = {}

    def get_bias(self):
        if self.training:
            return self.bias * 2
        if "bias" not in self.cache:
            self.cache["bias"] = self.bias * 2   # with grad enabled: it has a grad_fn
        return self.cache["bias"]

    def forward(self, x):
        return self.proj(x) + self.get_bias()


def test_tensor_cached_by_an_earlier_call_is_captured():
    eager, ours = _twins(CachesItsBias)
    eager.eval(), ours.eval()
    x = torch.randn(2, 4)
    for _ in range(4):
        torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
    info = nnscaler.cache_info(ours)
    # the first call writes the cache (runs eagerly); the next is captured, then hits
    assert info.fallbacks == 1 and info.captures == 1 and info.hits == 2, info
    # the cached tensor replaced: seen
    for model in (eager, ours):
        model.cache["bias"] = model.bias * 3
    torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
    # emptied: written again, then captured again
    for model in (eager, ours):
        model.cache.clear()
    for _ in range(2):
        torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
    ours.train(), eager.train()
    torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)


# ------------------------------------------------ writes that change nothing

class SetsItsWindow(nn.Module):
    """HF swin's set_shift_and_window_size: writes plain values on every call, which
    change the module only when the input is smaller than the window."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.shift_size = 1
        self.window = 4

    def forward(self, x):
        if x.shape[0] <= self.window:
            self.shift_size = 0
            self.window = min(x.shape[0], self.window)
        return self.proj(x) * (self.shift_size + 1)


def test_writes_of_the_value_already_there_are_captured():
    eager, ours = _twins(SetsItsWindow, dynamic=False)   # one capture per size, counted
    for n in (2, 2, 2, 3, 3, 8, 8):
        x = torch.randn(n, 4)
        torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
        assert (ours.window, ours.shift_size) == (eager.window, eager.shift_size)
    info = nnscaler.cache_info(ours)
    # the first call changes shift_size and window (captured, its writes replayed on
    # a hit from that state); then one capture per input size, each hit afterwards
    assert info.fallbacks == 0 and info.captures == 4 and info.hits == 3, info
    # put back from outside: the next call writes for real again, as eager does
    x = torch.randn(2, 4)
    for model in (eager, ours):
        model.shift_size, model.window = 1, 4
    torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
    assert (ours.window, ours.shift_size) == (eager.window, eager.shift_size) == (2, 0)
    assert nnscaler.cache_info(ours).hits == 4   # the first entry, writes replayed


class NamesItsAttributeAtRunTime(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.which = name
        self.mode = 1

    def forward(self, x):
        setattr(self, self.which, 1)    # a name no code holds as a literal, never read
        return self.proj(x)


def test_write_through_a_computed_name_is_not_taken_for_a_no_op():
    eager, ours = _twins(lambda: NamesItsAttributeAtRunTime("mo" + "de"))
    x = torch.randn(2, 4)
    for _ in range(2):
        torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
    for model in (eager, ours):
        model.mode = 5   # the forward writes 1 back over it
    for _ in range(2):
        torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
        assert ours.mode == eager.mode == 1




# ------------------------------------------------ tensors the trace did not see made

class ComputesOutOfSight(nn.Module):
    def forward(self, x):
        with torch._C.DisableTorchFunction():
            hidden = x * 2      # made below the dispatch the trace records
        return x + hidden


@pytest.mark.parametrize("grad", [False, True])
def test_tensor_made_out_of_sight_is_never_a_constant(grad):
    """Under no_grad such a tensor has no grad_fn to tell it from state: it must not
    become a constant that later calls replay."""
    model = nnscaler.compile(ComputesOutOfSight())
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            x = torch.randn(3)
            torch.testing.assert_close(model(x), x * 3)
    assert nnscaler.cache_info(model).hits == 0


def test_vmap_in_forward_is_eager_equal():
    class MapsRows(nn.Module):
        def forward(self, x):
            return torch.vmap(lambda row: row.sum() * row)(x)

    model = nnscaler.compile(MapsRows())
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 3)
            torch.testing.assert_close(model(x), x.sum(1, keepdim=True) * x)


def _returns_tuple(fn):
    """A generic decorator, as transformers' can_return_tuple: one wrapper code object
    for every class it decorates."""
    import functools

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return (fn(self, *args, **kwargs),)
    return wrapper


class DecoratedRenamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def run(self, x):
        return self.proj(x) * 2

    forward = _returns_tuple(run)


class DecoratedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    @_returns_tuple
    def forward(self, x):
        return self.proj(x) - 1


def test_decorated_forwards_are_captured_inside_their_wrapper():
    x = torch.randn(2, 4)
    for cls, fn in ((DecoratedRenamed, lambda m: m.proj(x) * 2),
                    (DecoratedForward, lambda m: m.proj(x) - 1)):
        model = nnscaler.compile(cls())
        for _ in range(3):
            (out,) = model(x)
            torch.testing.assert_close(out, fn(model), rtol=0, atol=0)
        report = nnscaler.explain(model, x)
        # the function the decorator wrapped is the graph; its wrapper runs as it is
        assert len(report.graphs) == 1 and "wrapper" not in report.entries[0].where, str(report)


# ------------------------------------------------ writes of new plain values, replayed

class PoolsWithAMultiplier(nn.Module):
    """HF funnel's attention structure: a plain attribute reset and updated on every
    call, left as the last call left it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.pooling_mult = None

    def forward(self, x):
        self.pooling_mult = 1
        for _ in range(3):
            x = self.proj(x) * self.pooling_mult
            self.pooling_mult *= 2
        return x


class CountsSteps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.steps = 0
        self.inner = nn.Identity()

    def forward(self, x):
        self.steps = self.steps + 1
        self.inner.last_rows = x.shape[0]     # a submodule's attribute, new once
        self.inner.phase = ("warm", self.steps > 2)
        return self.proj(x) * self.steps


def _plain_state(model: nn.Module) -> dict:
    return {(path, k): v for path, m in model.named_modules() for k, v in vars(m).items()
            if not k.startswith("_") and not isinstance(v, (nn.Module, torch.Tensor))}


@pytest.mark.parametrize("cls", [PoolsWithAMultiplier, CountsSteps])
def test_writes_of_new_plain_values_are_replayed(cls):
    eager, ours = _twins(cls)
    for n in (2, 2, 3, 2, 0, 1, 2, 2):
        x = torch.randn(n, 4)
        torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
        assert _plain_state(ours) == _plain_state(eager)
    info = nnscaler.cache_info(ours)
    assert info.fallbacks == 0, info


def test_replayed_writes_hit_once_the_state_repeats():
    eager, ours = _twins(PoolsWithAMultiplier)
    x = torch.randn(2, 4)
    for _ in range(5):
        torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
    # None -> 8 (first capture), then 8 -> 8 (second), then hits
    info = nnscaler.cache_info(ours)
    assert (info.captures, info.hits, info.fallbacks) == (2, 3, 0), info
    for model in (eager, ours):
        model.pooling_mult = None      # as built: the first entry hits, writes replayed
    torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
    assert ours.pooling_mult == eager.pooling_mult == 8
    assert nnscaler.cache_info(ours).hits == 4
    text = str(nnscaler.explain(ours, x))
    assert "self.pooling_mult = 8" in text, text


class WritesTheMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.last = None

    def forward(self, x):
        self.last = 1 if self.training else 0      # rewritten to ifexpr: a tracked int
        return self.proj(x) + self.last


def test_write_of_a_number_computed_from_the_mode_follows_it():
    eager, ours = _twins(WritesTheMode)
    x = torch.randn(2, 4)
    for training in (True, False, True, False, False):
        eager.train(training)
        ours.train(training)
        torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
        assert ours.last == eager.last == int(training)


class WritesBesideAHook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.calls_seen = 0
        self.proj.register_forward_hook(lambda m, i, o: o * 2)

    def forward(self, x):
        self.calls_seen = 7
        return self.proj(x)


class WritesThroughAProperty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self._scale = 1

    @property
    def scale(self):
        return self._scale

    @scale.setter
    def scale(self, value):
        self.__dict__["_scale"] = value + 1

    def forward(self, x):
        self.scale = 3
        return self.proj(x) * self.scale


class WritesAList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        self.shape_seen = list(x.shape)
        return self.proj(x)


@pytest.mark.parametrize("cls,why", [
    (WritesBesideAHook, "module with hooks"),
    (WritesThroughAProperty, "write to module state"),
    (WritesAList, "write to module state"),
])
def test_writes_that_cannot_be_replayed_run_eagerly(cls, why):
    eager, ours = _twins(cls)
    x = torch.randn(2, 4)
    for _ in range(3):
        torch.testing.assert_close(ours(x), eager(x), rtol=0, atol=0)
        assert _plain_state(ours) == _plain_state(eager)
    assert nnscaler.cache_info(ours).fallbacks == 3   # the forward ran eagerly each time
    text = str(nnscaler.explain(nnscaler.compile(cls()), x))   # state as built
    assert why in text, text
