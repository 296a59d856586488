"""3. Guard check alone: ours vs Dynamo's, for the same module.

Stacks of `depth` Linear+ReLU blocks (1, 12, 48) whose forward takes `inputs` tensor
arguments (1, 4, 16), batch 1, no_grad.  What is timed, interleaved:
- dynamo guard check: `entry.guard_manager.root.check(f_locals)` of the cache entry
  Dynamo made for the forward (`torch._dynamo.eval_frame._debug_get_cache_entry_list`),
  with f_locals = {'self': m, 'x0': ..., ...}: Dynamo's C++ guard tree, plus one
  pybind call (what the C++ hit path runs, minus that call);
- dynamo hit overhead: calling the torch.compile'd module minus calling the entry's
  transformed code directly (`types.FunctionType(entry.code, globals)(m, *xs)`):
  everything Dynamo does on a hit (OptimizedModule, callback, frame, guards);
- ours state guards: `entry.check_verbose()` of our cache entry.  On success it runs
  exactly the hit path's C check of the state guards (`cache_entry_check`: dict
  version tags of every module dict the trace went through, training flags), plus one
  METH_NOARGS call; it leaves out the per-call key (XXH3 of the inputs) and the
  lookup.  The nearest thing to Dynamo's guard check that can be timed from Python;
- ours hit overhead: calling the nnscaler-compiled module minus calling the cached
  runner directly (`bucket.entries[0].runner(m, *xs)`): nn.Module.__call__'s Python
  frame, our C wrapper, the frame shim, the per-call key (XXH3), the state guards and
  dispatch.  There is no C-level timing hook for our guard check alone, so this is an
  upper bound on it;
- nn.Module call overhead (eager): for a module whose forward only returns x0,
  `p(*xs)` minus `type(p).forward(p, *xs)`: the part of both hit overheads that is
  torch's own `__call__` machinery (measured on an empty module so that the forward's
  own cost, and its noise, stay out of the difference).
Differences are per repeat (the two loops ran next to each other), then summarised.
"""
from __future__ import annotations

import copy
import types
from typing import Any

import torch

from benchmarks import models
from benchmarks.harness import (
    NotAvailable, Row, Settings, Variant, derive, make_loop, measure,
)
from benchmarks.variants import compile_variant, first_call, nnscaler_module, reset_all

NAME = "guard_check"
TITLE = "Guard check and hit-path overhead (us per call)"


def grid(settings: Settings) -> list[tuple[int, int]]:
    if settings.quick:
        return [(1, 1), (12, 1), (48, 1), (1, 4), (1, 16)]
    return [(d, n) for n in (1, 4, 16) for d in (1, 12, 48)]


def dynamo_entry(module: torch.nn.Module) -> Any:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(type(module).forward.__code__)
    if not entries:
        raise NotAvailable("Dynamo made no cache entry for the forward")
    return entries[0]


def ours_entry(module: torch.nn.Module) -> Any:
    from nnscaler_eval import _C

    state = _C.code_state(type(module).forward.__code__) or {}
    for bucket in state.get("buckets", []):
        if bucket.self is module and bucket.entries:
            return bucket.entries[0]
    raise NotAvailable("no cache entry of ours for this module")


def ours_runner(module: torch.nn.Module) -> Any:
    runner = ours_entry(module).runner
    if runner is None:
        raise NotAvailable("our cache entry has no runner (runs eagerly)")
    return runner


def bench_label(depth: int, n_inputs: int) -> str:
    return f"depth {depth}, {n_inputs} input{'s' if n_inputs > 1 else ''}"


def run(settings: Settings) -> list[Row]:
    rows: list[Row] = []
    for depth, n_inputs in grid(settings):
        reset_all()
        torch.manual_seed(0)
        base = models.multi_input_stack(depth, n_inputs)
        xs = tuple(torch.randn(1, 8) for _ in range(n_inputs))
        state: dict[str, Any] = {}

        def eager_call() -> Any:
            m = copy.deepcopy(base)
            state["eager"] = m
            return make_loop(m, *xs)

        empty = models.passthrough(n_inputs)

        def empty_call() -> Any:
            return make_loop(empty, *xs)

        def empty_direct() -> Any:
            return make_loop(type(empty).forward, empty, *xs)

        def dynamo_call() -> Any:
            c = compile_variant(base, "dynamo", dynamic=False)
            c(*xs)
            state["dynamo"] = c
            return make_loop(c, *xs)

        def dynamo_parts() -> tuple[Any, Any, dict]:
            if "dynamo" not in state:
                raise NotAvailable("torch.compile variant did not build")
            c = state["dynamo"]
            m = c._orig_mod
            entry = dynamo_entry(m)
            f_locals = {"self": m, **{f"x{i}": x for i, x in enumerate(xs)}}
            if not entry.guard_manager.root.check(f_locals):
                raise NotAvailable("Dynamo's guards reject the frame's locals "
                                   "(the f_locals mapping does not match this torch)")
            return m, entry, f_locals

        def dynamo_check() -> Any:
            _, entry, f_locals = dynamo_parts()
            return make_loop(entry.guard_manager.root.check, f_locals)

        def dynamo_direct() -> Any:
            m, entry, _ = dynamo_parts()
            forward = type(m).forward
            fn = types.FunctionType(entry.code, forward.__globals__, "dynamo_direct")
            torch.testing.assert_close(fn(m, *xs), m(*xs))
            return make_loop(fn, m, *xs)

        def ours_call() -> Any:
            c = compile_variant(base, "ours")
            first_call("ours", c, lambda: c(*xs))
            state["ours"] = c
            return make_loop(c, *xs)

        def ours_direct() -> Any:
            nnscaler_module()
            if "ours" not in state:
                raise NotAvailable("nnscaler.compile variant did not build")
            m = state["ours"]
            runner = ours_runner(m)
            try:
                torch.testing.assert_close(runner(m, *xs), m(*xs))
            except Exception as exc:
                raise NotAvailable(f"runner(m, *xs) does not reproduce the call: {exc}") \
                    from exc
            return make_loop(runner, m, *xs)

        def ours_guards() -> Any:
            nnscaler_module()
            if "ours" not in state:
                raise NotAvailable("nnscaler.compile variant did not build")
            entry = ours_entry(state["ours"])
            if entry.check_verbose() is not None:
                raise NotAvailable(f"our state guards fail: {entry.check_verbose()}")
            state["n_guards"] = entry.n_state_guards
            return make_loop(entry.check_verbose)

        variants = [
            Variant("eager", eager_call, context=torch.no_grad),
            Variant("empty module call", empty_call, context=torch.no_grad),
            Variant("empty forward direct", empty_direct, context=torch.no_grad),
            Variant("dynamo", dynamo_call, context=torch.no_grad),
            Variant("dynamo direct", dynamo_direct, context=torch.no_grad),
            Variant("dynamo guard check", dynamo_check, context=torch.no_grad),
            Variant("ours", ours_call, context=torch.no_grad),
            Variant("ours runner direct", ours_direct, context=torch.no_grad),
            Variant("ours state guards", ours_guards, context=torch.no_grad),
        ]
        label = bench_label(depth, n_inputs)
        params = {"depth": depth, "inputs": n_inputs}
        measured = {r.variant: r for r in measure(NAME, label, variants, settings, unit="us",
                                                   baseline="eager", params=params)}
        module_call = derive(measured.pop("empty module call"),
                             measured.pop("empty forward direct"), "nn.Module call overhead",
                             "empty module: p(*xs) minus type(p).forward(p, *xs)")
        dyn = derive(measured["dynamo"], measured["dynamo direct"], "dynamo hit overhead",
                     "torch.compile'd call minus the entry's transformed code called directly")
        ours = derive(measured["ours"], measured["ours runner direct"], "ours hit overhead",
                      "compiled call minus runner(m, *xs); upper bound on our guard check")
        if ours.status == "ok" and dyn.status == "ok" and dyn.median and ours.median > 0:
            ours.ratio, ours.baseline = ours.median / dyn.median, "dynamo hit overhead"
        if ours.status == "ok" and ours.p10 is not None and ours.p10 < 0:
            ours.note = ("below this machine's timing noise here: the forward's own time "
                         "varies more between the two loops than our hit path costs; see "
                         "'ours state guards'")
        check = measured.pop("dynamo guard check")
        check.ratio = check.baseline = None
        guards = measured.pop("ours state guards")
        if guards.status == "ok" and check.status == "ok" and check.median:
            guards.ratio, guards.baseline = guards.median / check.median, "dynamo guard check"
            guards.note = f"{state.get('n_guards')} state guards in the entry"
        rows += list(measured.values()) + [check, guards, module_call, dyn, ours]
    reset_all()
    return rows
