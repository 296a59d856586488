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
  version tags of every module dict the trace went through, training flags, value
  guards), plus one METH_NOARGS call; it leaves out the per-call key (XXH3 of the
  inputs) and the lookup.  So it is NOT the scope of Dynamo's guard check, which
  includes the guards on the input tensors, and no ratio between the two is given:
  `make bench-ir` (benchmarks/bench_ir.py) counts both with the same scope (ours: key
  + lookup + state guards; Dynamo: its lookup), in instructions;
- ours hit overhead: calling the nnscaler-compiled module minus calling the cached
  runner directly (`bucket.entries[0].runner(m, *xs)`): nn.Module.__call__'s Python
  frame, our C wrapper, the frame shim, the per-call key (XXH3), the state guards and
  dispatch;
- nn.Module call overhead (eager): for a module whose forward only returns x0,
  `p(*xs)` minus `type(p).forward(p, *xs)`: the part of both hit overheads that is
  torch's own `__call__` machinery.
The three overheads are timed call by call, the two calls of each alternated
(`harness.paired_difference`): the median per repeat of the per-pair differences, then
summarised over the repeats.  (They used to be differences of two separately timed
loops; at depth 48, two ~750 us loops, that came out about 14x too high.)
"""
from __future__ import annotations

import copy
import types
from typing import Any

import torch

from benchmarks import models
from benchmarks.harness import (
    NotAvailable, Row, Settings, Variant, error_text, make_loop, measure, paired_difference,
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

        # Overheads: the two calls alternated call by call, not two loops (see
        # harness.paired_difference): at depth 48 the difference of two ~750 us loops
        # came out 14x above what callgrind counts (make bench-ir).
        def pair(variant: str, note: str, parts: Any) -> Row:
            try:
                with torch.no_grad():     # Dynamo's guards check the grad mode
                    a, b = parts()
            except Exception as exc:
                return Row(NAME, label, variant, "us", status="not available",
                           error=error_text(exc), params=dict(params))
            return paired_difference(NAME, label, variant, a, b, settings, note,
                                     params=params, context=torch.no_grad)

        module_call = pair("nn.Module call overhead",
                           "empty module: p(*xs) minus type(p).forward(p, *xs), "
                           "alternated call by call",
                           lambda: (lambda: empty(*xs),
                                    lambda: type(empty).forward(empty, *xs)))

        def dynamo_pair() -> tuple:
            if measured["dynamo"].status != "ok" or measured["dynamo direct"].status != "ok":
                raise NotAvailable("the torch.compile variant did not run")
            m, entry, _ = dynamo_parts()
            fn = types.FunctionType(entry.code, type(m).forward.__globals__, "dynamo_direct")
            c = state["dynamo"]
            return (lambda: c(*xs)), (lambda: fn(m, *xs))

        def ours_pair() -> tuple:
            if measured["ours"].status != "ok" or measured["ours runner direct"].status != "ok":
                raise NotAvailable("the nnscaler.compile variant did not run")
            m = state["ours"]
            runner = ours_runner(m)
            return (lambda: m(*xs)), (lambda: runner(m, *xs))

        dyn = pair("dynamo hit overhead", "torch.compile'd call minus the entry's "
                   "transformed code called directly, alternated call by call", dynamo_pair)
        ours = pair("ours hit overhead", "compiled call minus runner(m, *xs), alternated "
                    "call by call: nn.Module.__call__, our C wrapper and shim, the per-call "
                    "key, the lookup with its state guards, the runner call", ours_pair)
        if ours.status == "ok" and dyn.status == "ok" and dyn.median and ours.median > 0:
            ours.ratio, ours.baseline = ours.median / dyn.median, "dynamo hit overhead"
        check = measured.pop("dynamo guard check")
        check.ratio = check.baseline = None
        guards = measured.pop("ours state guards")
        # No ratio between these two: not the same scope.  Dynamo's check includes its
        # guards on the input tensors; check_verbose() leaves out our per-call key (the
        # inputs) and the lookup.  make bench-ir compares the same scope on both sides.
        guards.ratio = guards.baseline = None
        if guards.status == "ok":
            guards.note = (f"{state.get('n_guards')} state guards in the entry; without "
                           "the per-call key over the inputs, which Dynamo's check "
                           "includes: not comparable, see make bench-ir")
        rows += list(measured.values()) + [check, guards, module_call, dyn, ours]
    reset_all()
    return rows
