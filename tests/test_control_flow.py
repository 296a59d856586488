"""`if` statements on tensors captured as `torch.cond`, from the bytecode
(nnscaler_eval/capture/branches.py, nnscaler_eval/bytecode/).

Eager is the oracle: every forward of the suite (benchmarks/control_flow_models.py) is
run eagerly and compiled on inputs that take each side of each `if`; the compiled one
must give eager's results, as one graph, with no fallback and no recapture when a test
flips.  Forwards whose sides do what a graph cannot hold fall back with the reason.
"""
from __future__ import annotations

import copy
import dis
import sys

import pytest
import torch
import torch.nn as nn

import nnscaler
from benchmarks import control_flow_models as models
from nnscaler_eval.bytecode.code_graph import EXIT, Analysis
from nnscaler_eval.bytecode.versions import while_test_copied
from nnscaler_eval.capture import GraphBreakError

COND = torch.ops.higher_order.cond
WHILE = torch.ops.higher_order.while_loop


def _close(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.allclose(
            a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_close, a, b))
    return a == b


def _conds(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is COND]


def _whiles(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is WHILE]


@pytest.mark.parametrize("name", sorted(models.SUITE))
def test_suite_forward_is_one_graph_equal_to_eager_on_every_side(name):
    factory, inputs = models.SUITE[name]
    torch.manual_seed(0)
    eager = factory()
    compiled = nnscaler.compile(copy.deepcopy(eager))
    for args in inputs():
        assert _close(eager(*args), compiled(*args)), name
    info = nnscaler.cache_info(compiled)
    assert info.captures == 1, info          # no recapture when a test flips
    assert info.fallbacks == 0, info
    report = nnscaler.explain(compiled, *inputs()[0])
    assert not report.fallbacks
    assert len(report.graphs) == 1
    assert _conds(report.graphs[0]) or _whiles(report.graphs[0])
    assert report.branches and all(note.converted for note in report.branches)
    kinds = {note.kind for note in report.branches}
    assert ("while" in kinds) == bool(_whiles(report.graphs[0]))


@pytest.mark.parametrize("name", sorted(models.REFUSED))
def test_refused_forward_falls_back_with_its_reason(name):
    factory, inputs, words = models.REFUSED[name]
    torch.manual_seed(0)
    eager = factory()
    compiled = nnscaler.compile(copy.deepcopy(eager))
    for args in inputs():
        assert _close(eager(*args), compiled(*args))
    report = nnscaler.explain(compiled, *inputs()[0])
    assert len(report.fallbacks) == 1, report
    fallback = report.fallbacks[0]
    assert words in fallback.reason, fallback.reason
    assert fallback.filename == models.__file__
    notes = [n for n in report.branches if not n.converted]
    assert notes and all(n.filename == models.__file__ for n in notes)


def test_refusals_leave_state_as_eager_leaves_it():
    """The side eager does not take runs at capture on fake tensors only where it is
    checked: a refused side changed nothing (the list is appended once per call that
    eagerly takes it, never for the trace of the side not taken)."""
    models.TRACE_LOG.clear()
    model = nnscaler.compile(models.LogsToGlobalList())
    model(-torch.ones(3))          # eager takes the false side
    assert models.TRACE_LOG == []
    model(torch.ones(3))
    assert models.TRACE_LOG == ["positive"]


def test_counter_in_a_side_is_not_replayed_wrongly():
    eager = models.CountsSkips()
    compiled = nnscaler.compile(models.CountsSkips())
    for x in (torch.ones(2), -torch.ones(2), -torch.ones(2), torch.ones(2)):
        eager(x), compiled(x)
    assert compiled.skipped == eager.skipped == 2


def test_first_call_runs_the_taken_side_once_for_real():
    """The trace is a real run: the side taken runs once, eagerly (BatchNorm's
    statistics move once), the other not at all on real data."""

    class Stats(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.other = nn.BatchNorm1d(4)

        def forward(self, x):
            if x.sum() > 0:
                return self.bn(x)
            return self.other(x)

    eager, compiled = Stats(), nnscaler.compile(Stats())
    x = torch.randn(8, 4) + 1
    assert torch.allclose(eager(x), compiled(x))
    # BatchNorm updates its running stats in place: a side that mutates state
    # outside itself is refused, and the call falls back with eager's effects.
    assert torch.equal(eager.bn.running_mean, compiled.bn.running_mean)
    assert torch.equal(eager.other.running_mean, compiled.other.running_mean)
    assert compiled.bn.num_batches_tracked.item() == 1
    assert compiled.other.num_batches_tracked.item() == 0


def test_gradients_through_a_converted_if_equal_eager():
    torch.manual_seed(0)
    eager = models.NestedElif()
    compiled = nnscaler.compile(copy.deepcopy(eager))
    for scale in (0.1, 1.0, 10.0):
        x = torch.randn(4, models.HIDDEN) * scale
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager(xa).sum().backward()
        compiled(xb).sum().backward()
        assert torch.allclose(xa.grad, xb.grad, atol=1e-6)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert nnscaler.cache_info(compiled).captures == 1


def test_fullgraph_no_longer_raises_on_a_convertible_if():
    model = nnscaler.compile(models.SafeNormalize(), fullgraph=True)
    model(torch.randn(3, 5))
    model(torch.ones(3, 5))
    assert nnscaler.cache_info(model).captures == 1


def test_fullgraph_raises_the_reason_of_a_refused_if():
    model = nnscaler.compile(models.OptionalOutput(), fullgraph=True)
    with pytest.raises(GraphBreakError) as info:
        model(torch.randn(3, 4))
    assert "different structures" in str(info.value)
    assert models.__file__ in str(info.value)


def test_explain_names_each_converted_if_with_its_line():
    model = nnscaler.compile(models.NestedElif())
    report = nnscaler.explain(model, torch.randn(4, models.HIDDEN))
    lines = {note.lineno for note in report.branches}
    source = open(models.__file__).read().splitlines()
    assert all(source[n - 1].strip().startswith(("if ", "elif ")) for n in lines)
    assert len(lines) >= 2
    text = str(report)
    assert "torch.cond" in text and "`if` statements on tensors" in text


def test_logs_graph_prints_the_conversions(caplog):
    import logging

    from nnscaler_eval import logs
    with caplog.at_level(logging.DEBUG, logger="nnscaler.graph"):
        logs.graph.setLevel(logging.DEBUG)
        try:
            model = nnscaler.compile(models.SafeNormalize())
            model(torch.randn(3, 5))
        finally:
            logs.configure()
    assert any("torch.cond" in r.getMessage() and "if at" in r.getMessage()
               for r in caplog.records)


def test_early_return_of_an_argument_is_aliased_not_merged():
    """`return x` in one side: the graph's output is the cond's, not the input."""

    class ReturnInput(nn.Module):
        def forward(self, x):
            if x.abs().max() < 1:
                return x
            return x / x.abs().max()

    eager, compiled = ReturnInput(), nnscaler.compile(ReturnInput())
    for x in (torch.rand(3) * 0.5, torch.rand(3) * 5, torch.rand(3) * 0.1):
        assert torch.equal(eager(x), compiled(x))
    assert nnscaler.cache_info(compiled).captures == 1


def test_a_variable_a_side_leaves_unchanged_keeps_its_own_node():
    """`y = x` before, `y = x * 3` in one side: after the `if`, `x` is still `x`."""
    eager, compiled = _PassThrough(), nnscaler.compile(_PassThrough())
    for x in (torch.ones(3), -torch.ones(3), torch.ones(3)):
        a, b = eager(x), compiled(x)
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert nnscaler.cache_info(compiled).captures == 1


class _PassThrough(nn.Module):
    def forward(self, x):
        y = x
        if x.mean() > 0:
            y = x * 3
        return y, x + 1


def test_predicate_of_any_dtype_and_python_bool_tests_still_work():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.flag = True

        def forward(self, x, n: int):
            if self.flag and n > 1:          # Python values: specialised as before
                x = x * n
            if x.sum():                      # a float tensor: bool() is != 0
                x = x + 1
            return x

    eager, compiled = Mixed(), nnscaler.compile(Mixed())
    for x in (torch.ones(3), torch.zeros(3), torch.tensor([1.0, -1.0, 0.0])):
        assert torch.equal(eager(x, 2), compiled(x, 2))
    info = nnscaler.cache_info(compiled)
    assert info.captures == 1 and info.fallbacks == 0


def test_backend_aot_eager_gets_the_cond_node():
    torch.manual_seed(0)
    eager = models.SafeNormalize()
    compiled = nnscaler.compile(copy.deepcopy(eager), backend="aot_eager")
    for x in (torch.randn(3, 5), torch.ones(3, 5), torch.randn(3, 5)):
        assert torch.allclose(eager(x), compiled(x), atol=1e-6)
    assert nnscaler.cache_info(compiled).captures == 1


def test_export_keeps_the_cond_node():
    exported = nnscaler_eval_export(models.ResidualScale(), torch.randn(4, models.HIDDEN))
    assert _conds(exported)
    info = _conds(exported)[0].meta["nnscaler_if"]
    assert info["ifexpr_ok"] is True


def nnscaler_eval_export(module, *args):
    from nnscaler_eval.export import export
    return export(module, *args)


# -- the analysis, per CPython version ------------------------------------------------------

def _sites(fn):
    analysis = Analysis(fn.__code__)
    return sorted(analysis.sites.values(), key=lambda s: s.bool_at)


def test_analysis_finds_the_merge_and_the_locals_in_and_out():
    def f(self, x):
        h = x * 2
        if h.sum() > 0:
            y = h + 1
        else:
            y = h - 1
        z = y * 3
        return z

    (site,) = _sites(f)
    assert site.refusal is None
    assert site.live_in == ("h",)
    if sys.version_info < (3, 12):
        assert site.live_out == ("y",)
    else:
        # 3.12+ may copy the short tail into both sides; either way both sides meet
        assert site.live_out in (("y",), ())


def test_analysis_of_an_early_return_merges_at_the_exit():
    def f(self, x):
        if x.sum() > 0:
            return x
        x = x * 2
        return x + 1

    (site,) = _sites(f)
    assert site.merge == EXIT and site.refusal is None


def test_analysis_refusals_have_reasons():
    def in_try(self, x):
        try:
            if x.sum() > 0:
                x = x + 1
        except ValueError:
            pass
        return x

    def one_sided(self, x, n):
        if x.sum() > 0:
            z = x * 2
        if n > 0:
            x = z
        return x

    def breaks(self, x):
        for _ in range(3):
            if x.sum() > 0:
                break
            x = x + 1
        return x

    def loop_breaks(self, x):
        while x.sum() > 0:
            x = x - 1
            if x.mean() < 0:
                break
        return x

    def loop_unbound(self, x):
        while x.sum() > 0:
            y = x * 2
            x = x - y
        return y

    assert "try/with" in _sites(in_try)[0].refusal
    assert "one side only" in _sites(one_sided)[0].refusal
    assert "enclosing loop" in _sites(breaks)[0].refusal
    # a loop that can end by `break`: refused as a loop (3.11-3.13), or its test as an
    # `if` that a `while` runs again (3.14, whose loops are not rotated)
    refusals = [loop.refusal for loop in Analysis(loop_breaks.__code__).loops] + \
        [site.refusal for site in _sites(loop_breaks)]
    assert any("break" in r or "`while`" in r for r in refusals if r)
    assert "'y'" in Analysis(loop_unbound.__code__).loops[0].refusal


def test_analysis_finds_a_while_loop_its_carried_locals_and_inputs():
    def loop(self, x, tol):
        y = x
        while x.abs().max() > tol:
            t = x * 0.5            # a temporary of one iteration: not carried
            x = t
            y = y + x
        return x + y

    analysis = Analysis(loop.__code__)
    [found] = analysis.loops
    assert found.refusal is None
    assert found.carried == ("x", "y")
    assert found.inputs == ("tol",)
    assert found.line == loop.__code__.co_firstlineno + 2
    # both copies of the test (before the loop, after the body) are its sites, or the
    # one test the body jumps back to
    assert len(found.entries) == (2 if while_test_copied() else 1)
    assert all(analysis.sites[k].loop is found for k in found.entries)


class _Halve(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, tol):
        y = torch.zeros_like(x)
        while x.abs().max() > tol:
            x = x * 0.5
            y = y + self.lin(x)
        return x, y


def test_while_loop_equals_eager_for_any_number_of_iterations_without_recapture():
    torch.manual_seed(0)
    eager = _Halve()
    compiled = nnscaler.compile(copy.deepcopy(eager))
    x = torch.randn(3, 4) * 4
    peak = x.abs().max().item()
    # zero iterations, then one, several, zero again: one capture, one graph
    for tol in (peak * 2, peak * 0.6, 1e-3, peak * 2, 0.5):
        assert _close(eager(x, torch.tensor(tol)), compiled(x, torch.tensor(tol)))
    info = nnscaler.cache_info(compiled)
    assert info.captures == 1 and info.fallbacks == 0, info
    report = nnscaler.explain(compiled, x, torch.tensor(0.5))
    assert len(report.graphs) == 1 and len(_whiles(report.graphs[0])) == 1


def test_first_call_of_a_zero_iteration_loop_hands_back_the_values_as_they_were():
    eager, compiled = _Halve(), None
    compiled = nnscaler.compile(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    out = compiled(x, torch.tensor(100.0))     # the capture itself runs no iteration
    assert torch.equal(out[0], x) and torch.equal(out[1], torch.zeros_like(x))
    assert _close(eager(x, torch.tensor(0.1)), compiled(x, torch.tensor(0.1)))
    assert nnscaler.cache_info(compiled).captures == 1


def test_gradients_through_a_converted_while_equal_eager():
    torch.manual_seed(0)
    eager = _Halve()
    compiled = nnscaler.compile(copy.deepcopy(eager))
    for tol in (0.3, 100.0, 0.05):
        x = torch.randn(3, 4) * 2
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        sum(t.sum() for t in eager(xa, torch.tensor(tol))).backward()
        sum(t.sum() for t in compiled(xb, torch.tensor(tol))).backward()
        assert torch.allclose(xa.grad, xb.grad, atol=1e-6)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)
    assert nnscaler.cache_info(compiled).captures == 1


def test_a_loop_carrying_a_python_number_falls_back_naming_it():
    class Counts(nn.Module):
        def forward(self, x):
            n = 0
            while x.sum() > 1:
                x = x / 2
                n = n + 1
            return x * n

    eager, compiled = Counts(), nnscaler.compile(Counts())
    for x in (torch.ones(3), torch.ones(3) * 10, torch.zeros(3)):
        assert torch.equal(eager(x), compiled(x))
    report = nnscaler.explain(compiled, torch.ones(3) * 10)
    [fallback] = report.fallbacks
    assert "carries 'n', a int" in fallback.reason
    assert "`while`" in fallback.reason
    assert [n.kind for n in report.branches if not n.converted] == ["while"]


def test_fullgraph_does_not_raise_on_a_convertible_loop_and_raises_on_a_refused_one():
    model = nnscaler.compile(models.BeamSearchFixed(), fullgraph=True)
    model(torch.randn(3, 8))
    model(torch.randn(3, 8) * 4)
    assert nnscaler.cache_info(model).captures == 1
    refused = nnscaler.compile(models.GrowingBeam(), fullgraph=True)
    with pytest.raises(GraphBreakError) as info:
        refused(torch.tensor([[3], [5]]))
    assert "'tokens' changes shape" in str(info.value)
    assert models.__file__ in str(info.value)


def test_explain_and_logs_name_each_converted_loop_with_its_line(caplog):
    import logging

    from nnscaler_eval import logs
    model = nnscaler.compile(models.HaltingLoop())
    report = nnscaler.explain(model, torch.randn(4, models.HIDDEN))
    source = open(models.__file__).read().splitlines()
    loops = [n for n in report.branches if n.kind == "while"]
    assert len(loops) == 1 and loops[0].converted
    assert source[loops[0].lineno - 1].strip().startswith("while ")
    assert "while_loop" in str(report)
    with caplog.at_level(logging.DEBUG, logger="nnscaler.graph"):
        logs.graph.setLevel(logging.DEBUG)
        try:
            model = nnscaler.compile(models.FixedPointSolve())
            model(torch.randn(3, models.HIDDEN))
        finally:
            logs.configure()
    assert any("while at" in r.getMessage() and "while_loop" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="nnscaler.graph"):
        logs.graph.setLevel(logging.DEBUG)
        try:
            model = nnscaler.compile(models.GrowingBeam())
            model(torch.tensor([[3], [5]]))
        finally:
            logs.configure()
    assert any("while at" in r.getMessage() and "not converted" in r.getMessage()
               and "changes shape" in r.getMessage() for r in caplog.records)


def test_backend_aot_eager_gets_the_while_node():
    torch.manual_seed(0)
    eager = models.BeamSearchFixed()
    compiled = nnscaler.compile(copy.deepcopy(eager), backend="aot_eager")
    for args in models.SUITE["beam_search_fixed"][1]():
        assert _close(eager(*args), compiled(*args))
    assert nnscaler.cache_info(compiled).captures == 1


def test_export_keeps_the_while_node_and_export_for_nnscaler_names_it():
    from nnscaler_eval.export import ExportError
    from nnscaler_eval.parallelize import _retarget

    exported = nnscaler_eval_export(models.FixedPointSolve(), torch.randn(4, models.HIDDEN))
    [node] = _whiles(exported)
    assert node.meta["nnscaler_while"]["converted_from"] == "bytecode"
    with pytest.raises(ExportError) as info:
        _retarget(node, object())
    text = str(info.value)
    assert "`while` loop" in text and "no loops" in text
    assert f"{models.__file__}:{node.meta['nnscaler_while']['line']}" in text


class _ExplicitLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, n):
        from torch._higher_order_ops import while_loop

        def cond_fn(i, h):
            return i < n

        def body_fn(i, h):
            return i + 1, torch.tanh(self.lin(h))

        i, h = while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.long), x))
        return h * 2, i


def test_an_explicit_while_loop_is_one_node():
    torch.manual_seed(0)
    eager = _ExplicitLoop()
    compiled = nnscaler.compile(copy.deepcopy(eager))
    for n in (3, 0, 5, 1):
        x = torch.randn(2, 4)
        assert _close(eager(x, torch.tensor(n)), compiled(x, torch.tensor(n)))
    info = nnscaler.cache_info(compiled)
    assert info.captures == 1 and info.fallbacks == 0, info
    report = nnscaler.explain(compiled, torch.randn(2, 4), torch.tensor(2))
    assert not report.fallbacks and len(_whiles(report.graphs[0])) == 1
    # and eagerly, outside any capture, it still is torch's while_loop
    assert _close(eager(x, torch.tensor(2)), _ExplicitLoop.forward(compiled, x, torch.tensor(2)))


def test_analysis_sees_bool_where_this_version_takes_it():
    def f(self, x):
        if not x.any():
            x = x + 1
        return x

    (site,) = _sites(f)
    taken_at = dis.opname[Analysis(f.__code__).instrs[site.bool_at].opcode]
    if sys.version_info >= (3, 13):
        assert taken_at == "TO_BOOL"       # gh-106008
    else:
        assert taken_at.startswith("POP_JUMP")


def test_an_explicit_while_loop_carrying_an_int_falls_back_with_the_reason():
    class CountsInPython(nn.Module):
        def forward(self, x):
            from torch._higher_order_ops import while_loop

            i, h = while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h * 2), (0, x))
            return h + 1

    eager, compiled = CountsInPython(), nnscaler.compile(CountsInPython())
    for _ in range(3):
        x = torch.randn(3)
        assert torch.equal(eager(x), compiled(x))
    report = nnscaler.explain(compiled, torch.randn(3))
    [fallback] = report.fallbacks
    assert "while_loop: a carried value is a int" in fallback.reason
    # the library stays usable: a convertible loop in another module still converts
    other = nnscaler.compile(_ExplicitLoop())
    other(torch.randn(2, 4), torch.tensor(2))
    assert nnscaler.cache_info(other).fallbacks == 0


# -- Python that runs asynchronously while a side is traced -----------------------------


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:
            y = y * 2 + 1
        else:
            y = torch.tanh(y) - 1
        return y


def _first_call_collecting_always(callback):
    """A compiled `_Branchy` and its eager twin; the compiled one's first call (its
    capture) made with `callback` among `gc.callbacks` and a collection on every
    allocation.  Returns (compiled, eager, x, the first call's result)."""
    import gc

    threshold = gc.get_threshold()
    compiled, eager = copy.deepcopy(_Branchy()), _Branchy()
    eager.load_state_dict(compiled.state_dict())
    nnscaler.compile(compiled)
    x = torch.randn(3, 4)
    gc.callbacks.append(callback)
    try:
        gc.set_threshold(1)
        got = compiled(x)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(callback)
    return compiled, eager, x, got


def test_a_collection_during_a_side_runs_the_users_gc_callbacks_as_written():
    """Collections forced on every allocation while a forward with a tensor `if` is
    captured: none runs while a side is traced as checked code, so the user's gc
    callback is never refused there (no "Exception ignored"), its count is kept, and
    the `if` is still converted.  (No collection runs during the trace at all:
    tracing/asynchronous.py.)"""
    stats = {"collections": 0}

    def count(phase, info):
        if phase == "stop":
            stats["collections"] += 1   # an item store on an object from outside

    unraisable = []
    previous_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        compiled, eager, x, got = _first_call_collecting_always(count)
    finally:
        sys.unraisablehook = previous_hook
    assert [u.exc_value for u in unraisable] == []
    assert stats["collections"] > 0
    torch.testing.assert_close(got, eager(x))
    for flip in (x, -x, x * 3):
        torch.testing.assert_close(compiled(flip), eager(flip))
    info = nnscaler.cache_info(compiled)
    assert info.fallbacks == 0, info


def test_a_signal_handler_delivered_during_a_checked_side_runs_as_written(monkeypatch):
    """A signal noted while the side eager does not take is traced is delivered at
    the tracer's next point, inside the side: the handler is not the side's, so its
    write to outside state happens and is no refusal of the side.  (The signal is
    noted as the side's first op runs.)"""
    import signal

    from nnscaler_eval.capture import cond, signals

    flags = {"stop": 0}

    def on_usr1(signum, frame):
        flags["stop"] += 1   # a store on an object from outside the side

    # The wrapper stands for library code (a signal arrives in torch's C++): compiled
    # under our own file name, it runs as written, not as the side's checked code.
    scope = {"call_in_branch": cond.call_in_branch, "signals": signals, "signal": signal,
             "flags": flags}
    exec(compile("def noting(*args, **kwargs):\n"
                 "    if not flags['stop'] and signal.SIGUSR1 not in signals._pending:\n"
                 "        signals._pending.append(signal.SIGUSR1)\n"
                 "    return call_in_branch(*args, **kwargs)\n",
                 cond.__file__, "exec"), scope)
    monkeypatch.setattr(cond, "call_in_branch", scope["noting"])
    previous_handler = signal.signal(signal.SIGUSR1, on_usr1)
    compiled, eager = copy.deepcopy(_Branchy()), _Branchy()
    eager.load_state_dict(compiled.state_dict())
    nnscaler.compile(compiled)
    try:
        x = torch.randn(3, 4)
        got = compiled(x)
    finally:
        signal.signal(signal.SIGUSR1, previous_handler)
        signals._pending.clear()
    assert flags["stop"] == 1
    torch.testing.assert_close(got, eager(x))
    info = nnscaler.cache_info(compiled)
    assert info.fallbacks == 0 and info.captures == 1, info
