"""pytest plugin that runs Microsoft nnScaler's own tests against a chosen graph front end.

Loaded by `run.py` with `-p suite_plugin`; NNSCALER_SUITE_MODE says which front end:

- `front-end` (the default): nnscaler-eval's capture is nnScaler's front end. For each
  test, `nnscaler.graph.parser.to_fx_graph` and `nnscaler.graph.parser.converter.to_fx_graph`
  become `export_for_nnscaler` followed by nnScaler's `_rewrite_inplace_ops` (what
  `nnscaler_eval.parallelize` installs), and `parallelize` as the test modules and the
  `nnscaler` package name it becomes `nnscaler_eval.parallelize.parallelize`. Everything is
  put back after the test. While test modules are imported, `nnscaler.register_op` (ours)
  falls back to nnScaler's own when ours refuses a registration, so that the file still
  collects; each fallback is reported as a defect of ours.
- `installed`: nnscaler-eval installed, nnScaler's own tracer capturing (nothing patched).
- `alone`: nnScaler without nnscaler-eval (the plugin checks it cannot be imported).

In every mode, tests that nnScaler skips only for want of a CUDA device (a
`skipif(not torch.cuda.is_available())` decorator, no device count) run on the CPU,
except the few in NEED_CUDA:
under nnScaler's `replace_all_device_with('cpu', True)` and `mock_cube_env(0, 1)` from its
tests/utils.py, the CUDA calls of its op profiler no-ops
(memory peaks read 0, the device's memory is the host's), autodist's profiling in this
process instead of one spawned process per device, with `launch_torchrun(1, worker)` / `torchrun(1, worker)` calling the
worker in this process, and `init_process_group` made a one-rank gloo group.

In `front-end` mode, tests listed in expected_failures.txt are marked
`xfail(strict=True)`: one that passes fails the run.

Every report is appended as one JSON line to $NNSCALER_SUITE_REPORT for run.py.
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

MODE = os.environ.get("NNSCALER_SUITE_MODE", "front-end")
MODES = ("front-end", "installed", "alone")
EXPECTED_FAILURES = Path(__file__).with_name("expected_failures.txt")

# register_op calls of ours that refused and were handed to nnScaler's (front-end mode),
# while test modules are imported (the patches of collection time, closed after it).
_register_fallbacks: list[str] = []
_collecting = contextlib.ExitStack()
_one_gpu_tests: set[str] = set()


# -- results for run.py -----------------------------------------------------------------

def _record(entry: dict[str, Any]) -> None:
    path = os.environ.get("NNSCALER_SUITE_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


def _first_lines(report: Any) -> str:
    """The error's `file:line: message`; with chained exceptions, the first one (the
    cause: nnScaler wraps many in "Code generation failed") and then the last."""
    longrepr = getattr(report, "longrepr", None)
    crashes = [c for _, c, _ in getattr(longrepr, "chain", [])] or [
        getattr(longrepr, "reprcrash", None)]
    lines = [f"{Path(c.path).name}:{c.lineno}: {c.message.strip().splitlines()[0]}"
             for c in crashes if c and c.message.strip()]
    if lines:
        return "\n".join(dict.fromkeys([lines[0], lines[-1]]))
    text = str(longrepr or "")
    return "\n".join(text.strip().splitlines()[-3:])


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    outcome = None
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.failed:
            outcome = "failed" if report.when == "call" else "error"
        else:
            outcome = report.outcome
    elif report.when == "teardown" and report.failed:
        outcome = "error"
    if outcome is None:
        return
    entry = {"nodeid": report.nodeid, "when": report.when, "outcome": outcome,
             "one_gpu": report.nodeid in _one_gpu_tests}
    if outcome in ("failed", "error"):
        entry["error"] = _first_lines(report)
    elif outcome in ("skipped", "xfailed") and isinstance(report.longrepr, tuple):
        entry["error"] = report.longrepr[2]
    _record(entry)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _record({"nodeid": report.nodeid, "when": "collect", "outcome": "error",
                 "one_gpu": False, "error": _first_lines(report)})


# -- the mode: checked, and register_op's fallback while test modules are imported ------

def pytest_configure(config: pytest.Config) -> None:
    if MODE not in MODES:
        raise pytest.UsageError(f"NNSCALER_SUITE_MODE={MODE!r}: one of {', '.join(MODES)}")
    import importlib.util

    import nnscaler

    ours = getattr(nnscaler, "__nnscaler_eval_names__", None) is not None
    if MODE == "alone" and (ours or importlib.util.find_spec("nnscaler_eval") is not None):
        raise pytest.UsageError("mode alone: nnscaler-eval is importable in this interpreter")
    if MODE != "alone" and not ours:
        raise pytest.UsageError(f"mode {MODE}: nnscaler-eval's names are not on nnScaler's "
                                "package (is its .pth installed?)")
    if MODE == "front-end":
        _collecting.enter_context(_patched(nnscaler, "register_op", _register_op_with_fallback(
            nnscaler.register_op)))


def pytest_collection_finish(session: pytest.Session) -> None:
    _collecting.close()  # test bodies get register_op as it is
    for note in _register_fallbacks:
        _record({"nodeid": "", "when": "collect", "outcome": "note", "error": note})


def _register_op_with_fallback(ours: Callable[..., Any]) -> Callable[..., Any]:
    from nnscaler.graph.parser.register import register_op as theirs

    def refused(exc: Exception, args: tuple, kwargs: dict, fn: Any) -> None:
        where = f"{fn.__module__}.{fn.__qualname__}"
        annotation = args[0] if args else kwargs.get("annotation")
        _register_fallbacks.append(
            f"register_op({annotation!r}) for {where} refused by nnscaler-eval: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0]}; registered with nnScaler's "
            "register_op instead")

    def register_op(*args: Any, **kwargs: Any) -> Any:
        if _collecting_closed():
            return ours(*args, **kwargs)  # called by a test body: no fallback
        try:
            decorator = ours(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- every refusal is reported
            error = exc  # `exc` is unbound when the except block ends

            def register_theirs(fn: Any) -> Any:  # nnScaler's register_op is a decorator
                refused(error, args, kwargs, fn)
                return theirs(*args, **kwargs)(fn)
            return register_theirs
        if not callable(decorator) or hasattr(decorator, "__nnscaler_op__"):
            return decorator  # register_op(fn, ...): already registered

        def register(fn: Any) -> Any:
            try:
                return decorator(fn)
            except Exception as exc:  # noqa: BLE001
                refused(exc, args, kwargs, fn)
                return theirs(*args, **kwargs)(fn)
        return register

    return register_op


def _collecting_closed() -> bool:
    return not _collecting._exit_callbacks  # type: ignore[attr-defined]


# -- 1-GPU tests on the CPU -------------------------------------------------------------

# 1-GPU tests that stay skipped: they need a CUDA device itself, whatever the front end
# (they fail on the CPU with nnScaler's own tracer too, for these reasons).
NEED_CUDA = {
    "parallel_module/test_gencode.py::test_codegen_function_to":
        "`x.to(0)` (CUDA device 0): replace_all_device_with moves str and torch.device only",
    "parallel_module/test_gencode_torch_compile.py::test_codegen_compile_apply":
        "torch.compile'd code in the forward: inductor needs CUDA here, and under "
        "replace_all_device_with its meta tensors are made on the CPU",
    "parallel_module/test_gencode_torch_compile.py::test_codegen_compile_f":
        "torch.compile'd code in the forward: inductor needs CUDA here, and under "
        "replace_all_device_with its meta tensors are made on the CPU",
}

_CUDA_ONLY = {ast.dump(ast.parse(src, mode="eval").body) for src in (
    "not torch.cuda.is_available()",
    "not torch.cuda.is_available() or torch.cuda.device_count() < 1",
)}


def _skips_only_without_cuda(fn: Any) -> bool:
    """Is `fn` decorated with pytest.mark.skipif(<no CUDA device>) and no device count?"""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    definition = tree.body[0]
    for decorator in getattr(definition, "decorator_list", []):
        if (isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("mark.skipif")
                and decorator.args and ast.dump(decorator.args[0]) in _CUDA_ONLY):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expected = _expected_failures() if MODE == "front-end" else {}
    for item in items:
        fn = getattr(item, "function", None)
        if (fn is not None and _skips_only_without_cuda(fn)
                and item.nodeid.split("/", 1)[1] not in NEED_CUDA):
            item.own_markers = [m for m in item.own_markers if m.name != "skipif"]
            _one_gpu_tests.add(item.nodeid)
        reason = expected.pop(item.nodeid, None)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    collected = {item.nodeid.split("::")[0] for item in items}
    stale = [nodeid for nodeid in expected if nodeid.split("::")[0] in collected]
    if stale:
        raise pytest.UsageError(f"{EXPECTED_FAILURES.name} names tests that do not exist: "
                                + ", ".join(stale))


def _expected_failures() -> dict[str, str]:
    """expected_failures.txt: `<test id>  # <reason>` lines (ids relative to tests/)."""
    entries = {}
    for line in EXPECTED_FAILURES.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            nodeid, _, reason = line.partition("#")
            entries["tests/" + nodeid.strip()] = reason.strip()
    return entries


@contextlib.contextmanager
def _one_rank_on_cpu(item: pytest.Item) -> Iterator[None]:
    """nnScaler's CPU stand-ins (its tests/utils.py), one gloo rank, workers in process."""
    import torch.distributed as dist
    from tests.utils import clear_parallel_cache, mock_cube_env, replace_all_device_with

    init_process_group = dist.init_process_group
    set_default_device = torch.set_default_device
    default_device = torch.get_default_device()

    def one_rank_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
        kwargs.update(backend="gloo", rank=0, world_size=1, store=dist.HashStore())
        kwargs.pop("init_method", None)
        return init_process_group(*args, **kwargs)

    def cpu_default_device(device: Any) -> None:
        return set_default_device("cpu" if device is not None and "cuda" in str(device)
                                  else device)

    def launch_in_process(nproc_per_node: int, worker_fn: Callable[..., Any], *args: Any,
                          **kwargs: Any) -> dict[int, Any]:
        if nproc_per_node != 1:
            raise RuntimeError(f"nnscaler suite: launch of {nproc_per_node} processes; "
                               "only one rank runs on the CPU")
        try:
            return {0: worker_fn(*args, **kwargs)}
        finally:  # what the end of a worker process would undo
            if dist.is_initialized():
                dist.destroy_process_group()
            set_default_device(default_device)
            clear_parallel_cache()

    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def torchrun_in_process(nproc_per_node: int, test_fn: Callable[..., Any], *args: Any,
                            **kwargs: Any) -> None:
        launch_in_process(nproc_per_node, test_fn, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(replace_all_device_with("cpu", True))
        stack.enter_context(mock_cube_env(0, 1))
        stack.enter_context(_patched(dist, "init_process_group", one_rank_group))
        stack.enter_context(_patched(torch, "set_default_device", cpu_default_device))
        # what nnScaler's op profiler (nnscaler/profiler/database.py) asks of the device
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            stack.enter_context(_patched(torch.cuda, name, lambda *args, **kwargs: None))
        stack.enter_context(_patched(torch.cuda, "max_memory_allocated", lambda *a, **k: 0))
        # autodist's memory budget: the device's (free, total) memory; this host's here
        stack.enter_context(_patched(torch.cuda, "mem_get_info",
                                     lambda *a, **k: (host_memory, host_memory)))
        # autodist profiles in one spawned process per CUDA device: the one device is this one
        from nnscaler.autodist.cost_database import CostDatabase
        profile_comp = CostDatabase.profile_comp
        stack.enter_context(_patched(CostDatabase, "profile_comp", lambda self, degree, parallel,
                                     re_profile: profile_comp(self, degree, False, re_profile)))
        for name, value in (("launch_torchrun", launch_in_process),
                            ("torchrun", torchrun_in_process)):
            if name in item.module.__dict__:
                stack.enter_context(_patched(item.module, name, value))
        try:
            yield
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            set_default_device(default_device)
            clear_parallel_cache()


# -- our capture as the front end, per test ---------------------------------------------

@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    missing = object()
    old = owner.__dict__.get(name, missing) if isinstance(owner, type) else getattr(
        owner, name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, old)


def _our_to_fx_graph() -> Callable[..., Any]:
    from nnscaler.graph.parser.converter import _rewrite_inplace_ops

    from nnscaler_eval.parallelize import export_for_nnscaler

    def to_fx_graph(model: torch.nn.Module, dummy_input: dict) -> torch.fx.GraphModule:
        gm = export_for_nnscaler(model, **dummy_input)
        _rewrite_inplace_ops(gm)  # what nnScaler's to_fx_graph does after its trace
        return gm
    return to_fx_graph


@contextlib.contextmanager
def _our_front_end(tests_root: Path) -> Iterator[None]:
    import nnscaler
    import nnscaler.graph.parser as parser
    import nnscaler.graph.parser.converter as converter
    import nnscaler.parallel

    from nnscaler_eval.api import reset
    from nnscaler_eval.parallelize import parallelize as our_parallelize

    our_to_fx_graph = _our_to_fx_graph()
    replace = {id(converter.to_fx_graph): our_to_fx_graph,
               id(nnscaler.parallel.parallelize): our_parallelize}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(parser, "to_fx_graph", our_to_fx_graph))
        stack.enter_context(_patched(converter, "to_fx_graph", our_to_fx_graph))
        stack.enter_context(_patched(nnscaler, "parallelize", our_parallelize))
        # names the test modules imported (`from ...converter import to_fx_graph`)
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if not path or not Path(path).is_relative_to(tests_root):
                continue
            for name, value in list(vars(module).items()):
                if id(value) in replace:
                    stack.enter_context(_patched(module, name, replace[id(value)]))
        try:
            yield
        finally:
            reset()  # our capture caches: nothing carried to the next test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if MODE == "front-end":
            stack.enter_context(_our_front_end(Path(str(item.session.config.rootpath))))
        if item.nodeid in _one_gpu_tests:
            stack.enter_context(_one_rank_on_cpu(item))
        yield
