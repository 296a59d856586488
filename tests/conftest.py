"""Shared fixtures: every test starts with empty caches and a disarmed thread, and
fails if it leaves the frame evaluator installed."""
from __future__ import annotations

import gc

import pytest
import torch

import nnscaler
from nnscaler_eval import _C
from nnscaler_eval.tracing import trace_patches, trace_state


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    import leakcheck
    leakcheck.LONG = bool(config.getoption("--run-slow"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow (make leakcheck)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _clean_state():
    nnscaler.reset()
    torch.manual_seed(0)
    yield
    nnscaler.reset()
    gc.collect()
    # What outlived the test outlives the next ones too (imports, module-level
    # models): a full collection after every test walked all of it, a second per test
    # by the end of the suite.  Frozen, later collections skip it; objects made from
    # here on are collected as before.
    gc.freeze()
    assert _C.current_config() is None, "test left this thread armed"
    assert _C.armed_threads() == 0, "test left a thread armed"
    # Not is_default_eval_frame(): once torch.compile ran (eager torch.cond does),
    # Dynamo's evaluator stays installed for the process; ours must not be.
    assert not _C.eval_frame_installed(), "our frame evaluator is still installed"
    # A trace that never left (on any thread) breaks every later test that traces.
    assert trace_state.current_tracer() is None, "test left a current tracer"
    assert trace_patches.active_traces() == 0, "test left a trace running"
