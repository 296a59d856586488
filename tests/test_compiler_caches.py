"""torch's compiler caches across processes: Inductor's FX graph cache and AOTAutograd's
cache keep our graphs, and a second process with the same cache directory hits them
(tests/compiler_cache_worker.py runs the models); graphs whose behaviour the caches'
keys cannot see (user code: opaque submodules, register_op ops) stay out of them.

The in-process tests look at the graph a backend receives, as Dynamo would hand it
(runners/backend_form.py), without compiling anything."""
from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch._functorch._aot_autograd.autograd_cache import (
    BypassAOTAutogradCache,
    check_cacheable,
)

import nnscaler

WORKER = pathlib.Path(__file__).with_name("compiler_cache_worker.py")


def _worker(cache_dir: pathlib.Path, *args: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
               TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("TORCHINDUCTOR_FX_GRAPH_CACHE", None)
    env.pop("TORCHINDUCTOR_AUTOGRAD_CACHE", None)
    done = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True,
                          text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_cold(case: dict, graphs: int, compiled_graphs: int) -> None:
    counters = case["counters"]
    assert counters.get("autograd_cache_bypass", 0) == 0, counters
    assert counters.get("fxgraph_cache_bypass", 0) == 0, counters
    assert counters.get("autograd_cache_saved", 0) == graphs, counters
    assert counters.get("fxgraph_cache_miss", 0) == compiled_graphs, counters


def _assert_warm(case: dict, graphs: int, compiled_graphs: int) -> None:
    counters = case["counters"]
    assert counters.get("autograd_cache_hit", 0) == graphs, counters
    assert counters.get("autograd_cache_miss", 0) == 0, counters
    assert counters.get("fxgraph_cache_hit", 0) == compiled_graphs, counters
    assert counters.get("fxgraph_cache_miss", 0) == 0, counters


CASES = ("inductor:static", "inductor:symbolic", "inductor:blocks",
         "aot_eager+cache:static", "aot_eager+cache:symbolic", "aot_eager+cache:blocks")


def test_compiler_caches_hit_in_a_second_process(tmp_path):
    """Inductor, static: a train() graph (forward and backward: two Inductor graphs)
    and an eval() graph; symbolic (dynamic=True): one graph for two batch sizes,
    forward and backward; blocks: the same two graphs of three equal blocks, which
    block reuse makes calls of one shared subgraph (invoke_subgraph).  Every output, gradient and BatchNorm buffer equals eager's
    in both processes, the warm one included, whose graphs all come from the caches
    although its weights, constant tensor and inputs are others (the caches key code
    and metadata; values are inputs of the compiled code).
    aot_eager keeps AOTAutograd's cache across processes only with torch's
    force_autograd_cache and bundled_autograd_cache (torch.compile's too): with them,
    ours hit as well."""
    cold = _worker(tmp_path, "0", *CASES)
    warm = _worker(tmp_path, "1", *CASES)   # other weights, constants and inputs
    for run in (cold, warm):
        for case in CASES:
            assert run[case]["equal"], (case, run[case])
            # blocks: nothing reads the training flag, one capture (compiled per grad mode)
            assert run[case]["captures"] == (2 if case.endswith("static") else 1), run[case]
            if case.endswith("blocks"):
                assert run[case]["shared"] == [["blocks.0", "blocks.1", "blocks.2"]], run[case]
    _assert_cold(cold["inductor:static"], graphs=2, compiled_graphs=3)
    _assert_cold(cold["inductor:symbolic"], graphs=1, compiled_graphs=2)
    _assert_warm(warm["inductor:static"], graphs=2, compiled_graphs=3)
    _assert_warm(warm["inductor:symbolic"], graphs=1, compiled_graphs=2)
    _assert_cold(cold["inductor:blocks"], graphs=2, compiled_graphs=3)
    _assert_warm(warm["inductor:blocks"], graphs=2, compiled_graphs=3)
    assert cold["aot_eager+cache:static"]["counters"] == {"autograd_cache_miss": 2,
                                                         "autograd_cache_saved": 2}
    assert cold["aot_eager+cache:symbolic"]["counters"] == {"autograd_cache_miss": 1,
                                                           "autograd_cache_saved": 1}
    assert warm["aot_eager+cache:static"]["counters"] == {"autograd_cache_hit": 2}
    assert warm["aot_eager+cache:symbolic"]["counters"] == {"autograd_cache_hit": 1}
    assert cold["aot_eager+cache:blocks"]["counters"] == {"autograd_cache_miss": 2,
                                                         "autograd_cache_saved": 2}
    assert warm["aot_eager+cache:blocks"]["counters"] == {"autograd_cache_hit": 2}


# -- the graph a backend receives -------------------------------------------------------


class Recorder:
    """A backend that keeps what it was handed and the context it was handed it in."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, gm, example_inputs):
        from torch._guards import TracingContext

        context = TracingContext.try_get()
        self.calls.append({"gm": gm, "inputs": list(example_inputs), "context": context})
        return gm.forward


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        y = self.bn(self.fc(x)).relu()
        with torch.no_grad():
            shift = x.mean()
        return (y * 2 if self.training else y - 1) + shift


def _example_values(gm) -> dict:
    return {n.name: n.meta.get("example_value") for n in gm.graph.nodes if n.op != "output"}


def test_a_static_graph_comes_as_dynamo_hands_it():
    """A TracingContext whose fake mode has a ShapeEnv (the FX graph cache needs one),
    the real tensors as example inputs, no symbol anywhere, and every node's value on
    fakes in meta["example_value"] (AOTAutograd's cache checks method receivers by it)."""
    backend = Recorder()
    model = nnscaler.compile(Small(), backend=backend)
    x = torch.randn(4, 8)
    model(x)
    (call,) = backend.calls
    gm, context = call["gm"], call["context"]
    assert context is not None and context.fake_mode.shape_env is not None
    assert call["inputs"][0] is x
    assert all("example_value" in n.meta for n in gm.graph.nodes if n.op != "output")
    values = _example_values(gm)
    # grad mode set twice (None); every other node a fake tensor of the context's mode
    assert [v for v in values.values() if not isinstance(v, torch.Tensor)] == [None, None]
    assert all(v.fake_mode is context.fake_mode for v in values.values() if v is not None)
    assert not context.fake_mode.shape_env.backed_var_to_val   # static: no symbol made
    check_cacheable(gm)   # raises BypassAOTAutogradCache if the cache would refuse it
    # the fake run left the global state as it was (the graph sets grad mode)
    assert torch.is_grad_enabled()


def test_a_symbolic_graph_comes_in_its_own_shape_env():
    backend = Recorder()
    model = nnscaler.compile(Small(), backend=backend, dynamic=True)
    model(torch.randn(5, 8))
    model(torch.randn(7, 8))
    (call,) = backend.calls
    gm, context = call["gm"], call["context"]
    (fake,) = call["inputs"]
    assert context.fake_mode is fake.fake_mode and context.fake_mode.shape_env is not None
    assert isinstance(fake.shape[0], torch.SymInt)
    assert isinstance(_example_values(gm)["x"].shape[0], torch.SymInt)
    check_cacheable(gm)


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.register_forward_hook(_triple)

    def forward(self, x):
        return self.b(self.a(x)).relu()


def _triple(module, args, output):
    return output * 3


@nnscaler.register_op("* k, k -> * k")
def _scaled(x, w):
    return x * w


class WithOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return _scaled(x, self.w).relu()


@pytest.mark.parametrize("make", [Hooked, WithOp], ids=["hooked submodule", "register_op"])
def test_a_graph_that_runs_user_code_stays_out_of_aot_autograds_cache(make):
    """A module with hooks (a module-level hook, which pickles: the cache would key it by
    its name, not its code) and a register_op op run user code that no cache key sees:
    the graph calls them through a function no cache takes as safe, and is not run on
    fakes (the user's Python would run)."""
    backend = Recorder()
    eager = make()
    model = nnscaler.compile(copy.deepcopy(eager), backend=backend)
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), eager(x))
    gm = backend.calls[0]["gm"]
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    assert all("example_value" not in n.meta for n in gm.graph.nodes)
    with pytest.raises(BypassAOTAutogradCache):
        check_cacheable(gm)


# -- Inductor's start for CPU code, begun early (runners/inductor_start.py) ----------------

_ISA_ANSWERS = r"""
import json, sys
import torch
from torch._inductor import cpu_vec_isa
from nnscaler_eval.runners import inductor_start

begun = sys.argv[1] == "begin"
asked_again = []
if begun:
    inductor_start.begin()
    inductor_start._asking.join()   # every answer made, Inductor's function back
    # Every answer is now Inductor's memo: asking again builds and loads nothing.
    cpu_vec_isa.VecISA.check_build = lambda self, code: asked_again.append(str(self))
valid = cpu_vec_isa.valid_vec_isa_list()
picked = cpu_vec_isa.pick_vec_isa()
print(json.dumps({
    "valid": [[str(isa), isa.build_arch_flags(),
               getattr(isa, "_is_avx512_bf16_supported", None),
               getattr(isa, "_is_amx_fp16_supported", None)] for isa in valid],
    "picked": [str(picked), picked.build_arch_flags()],
    "asked_again": asked_again,
    "candidates": [str(isa) for isa in inductor_start._candidates(cpu_vec_isa)],
}))
"""


def test_inductor_start_begun_early_gives_inductors_own_answers(tmp_path):
    """The questions Inductor asks about the CPU's vector instruction sets, asked early
    in parallel threads, leave exactly Inductor's own answers and side effects (the
    AVX-512 candidate's bf16 flag, the flags every kernel is built with) and leave
    nothing for Inductor to ask again; a process that asks nothing early, with the
    same cache folder, gets the same answers from Inductor alone."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))

    def answers(how: str) -> dict:
        done = subprocess.run([sys.executable, "-c", _ISA_ANSWERS, how], capture_output=True,
                              text=True, env=env, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    early, alone = answers("begin"), answers("plain")
    assert early["valid"] == alone["valid"] and early["picked"] == alone["picked"]
    assert early["asked_again"] == []
    # Every candidate asked early is one Inductor asks about, in its order.
    assert [isa[0] for isa in alone["valid"]] == [
        name for name in early["candidates"] if name in {isa[0] for isa in alone["valid"]}]


_ISA_WAIT = r"""
import json, threading, time
from torch._inductor import cpu_vec_isa
from nnscaler_eval.runners import inductor_start

asked = cpu_vec_isa.valid_vec_isa_list
builds = []


def slow_build(self, code):
    # Stands in for the C++ build and load, slow enough that Inductor's question
    # comes while every candidate is still being answered.
    builds.append(str(self))
    time.sleep(1.0)
    builds.append(("done", str(self), time.monotonic()))
    return True


cpu_vec_isa.VecISA.check_build = slow_build
inductor_start.begin()
inductor_start.ready()
waiting = cpu_vec_isa.valid_vec_isa_list is not asked
valid = cpu_vec_isa.valid_vec_isa_list()      # Inductor's question, from this thread
answered = time.monotonic()
inductor_start._asking.join()   # every answer made, Inductor's function back
built = len(builds)
cpu_vec_isa.valid_vec_isa_list()
print(json.dumps({
    "asked_again": len(builds) - built,
    "waiting": waiting,
    "valid": [str(isa) for isa in valid],
    "asked_once": [b for b in builds if isinstance(b, str)],
    "answered_after_builds": all(b[2] <= answered for b in builds if not isinstance(b, str)),
    "restored": cpu_vec_isa.valid_vec_isa_list is asked,
    "candidates": [str(isa) for isa in inductor_start._candidates(cpu_vec_isa)],
}))
"""


def test_inductors_question_waits_for_the_answers_begun(tmp_path):
    """Inductor asks while the threads still answer: its `valid_vec_isa_list` waits for
    them (the question is answered once per candidate, by the threads), and once they
    are done Inductor's own function is back in place."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _ISA_WAIT], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not out["candidates"]:
        pytest.skip("no vector instruction set to ask about on this machine")
    assert out["waiting"]
    assert set(out["asked_once"]) == set(out["candidates"]) and out["asked_again"] == 0
    assert out["valid"] == out["candidates"]
    assert out["answered_after_builds"]
    assert out["restored"]


_FORKED_READY = r"""
import os, time
from nnscaler_eval.runners import inductor_start

inductor_start.begin()          # the thread starts importing Inductor: a second or so
pid = os.fork()
if pid == 0:
    set_at_fork = inductor_start._guarded.is_set()
    start = time.monotonic()
    inductor_start.ready()      # the thread is not in this process
    os._exit(0 if time.monotonic() - start < 5 else 1 if not set_at_fork else 2)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_process_forked_while_the_start_is_begun_does_not_wait_for_it():
    """A process forked before the start's thread made Inductor's questions wait
    (DataLoader workers, a launcher) has no such thread: its `ready()` returns
    instead of waiting for ever."""
    done = subprocess.run([sys.executable, "-c", _FORKED_READY], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "0", done.stderr[-4000:]


def test_inductor_start_begins_only_for_inductor_on_the_cpu(monkeypatch):
    from nnscaler_eval.runners import inductor_start

    begun = []
    monkeypatch.setattr(inductor_start, "_asking", None)
    monkeypatch.setattr(inductor_start, "begin", lambda: begun.append(True))
    cpu_model, meta_model = nn.Linear(2, 2), nn.Linear(2, 2, device="meta")
    inductor_start.begin_for("inductor", cpu_model)
    inductor_start.begin_for("inductor", None, [3, torch.ones(1)])
    assert begun == [True, True]
    inductor_start.begin_for("eager", cpu_model)
    inductor_start.begin_for("aot_eager", cpu_model)
    inductor_start.begin_for("inductor", meta_model, [torch.ones(1, device="meta")])
    inductor_start.begin_for("inductor", nn.ReLU(), [2.0])
    assert begun == [True, True]
    # A model that will compute on the CPU, compiled for Inductor, begins at compile().
    model = nnscaler.compile(nn.Linear(2, 2), backend="inductor")
    assert begun == [True, True, True]
    del model
