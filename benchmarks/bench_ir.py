"""Instructions per call (callgrind): eager PyTorch, `nnscaler.compile(backend="eager")`
and `torch.compile(backend="eager")` on the same cases, the same loop on every side.

    python -m benchmarks.bench_ir [--quick] [--cases inputs,gpt,...] [--out DIR]
    make bench-ir

Why instructions: on the shared 2-core machine these figures are for, timings of
microsecond differences move by more than the differences (a "hit overhead" at depth
48 taken as the difference of two ~750 us loops came out 14x too high).  Instruction
counts (valgrind's callgrind, `Ir`) of the same code are reproducible to a fraction of a
percent, and both systems run the same CPU, so they compare the work done; they do not
weigh cache misses or branch mispredictions, so they are not times.

Method.  The selected groups run in one `valgrind --tool=callgrind --instr-atstart=no`
process (the worker: `--worker GROUP,...`).  It builds every side of every point
(deep copies of one model, same weights; each point gets classes and code objects of
its own, so no two share a cache), makes the first calls (captures, compiles) and
warm-up calls uninstrumented, freezes and disables the garbage collector, then switches
instrumentation on (a client request from `benchmarks/cgmark.c`, built on the fly and
loaded with ctypes) and, for each point and side, after a few more warm-up calls: zero
the counters, run `loop(n)` (`for _ in range(n): m(*xs)`), dump the counters; for
n = N1, N2, N1, N2, N1, N2.  Each pair gives (Ir(N2) - Ir(N1)) / (N2 - N1) (divided
by the calls one iteration makes, for round-robin loops); the figure is the median of
the three, "±" the median distance from it.  Everything outside the loop (the ctypes
calls into the client requests, the loop's set-up) cancels.  The loop's own iteration
(about 40 Ir) is inside every side's figure.  One torch thread.

After the loops the worker checks that nothing recompiled: ours' `cache_info` shows no
new capture or miss, Dynamo's `unique_graphs` counter did not move; a side that did is
reported as not valid.

Same-scope guard check.  From the same dumps, inclusive instructions of the functions
that decide a hit (summed from the dump the way `callgrind_annotate --inclusive=yes`
does): ours = `cache_tables_find` +
`cache_table_find` (the config's table, then the owner's bucket: both O(1) hash probes) + `call_key_build` (the
per-call key over the inputs) + `cache_lookup` (key compare and the state guards,
`cache_entry_check`); Dynamo = `lookup` in libtorch_python (every
entry's root guard manager, tensor guards on the inputs included, until one passes).
Both: all guards of one hit, inputs included, plus finding the entry; neither counts
building the frame's locals view.

Derived figures (see `derive()`): hit overhead, per-tensor instructions, the shim per
non-target frame, the 512th instance against the 1st.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import gc
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MARK_SRC = os.path.join(ROOT, "benchmarks", "cgmark.c")
MARK_LIB = os.path.join(ROOT, "build", "bench_ir", "libcgmark.so")
BARE_HOOK_SRC = os.path.join(ROOT, "benchmarks", "bare_hook.c")
BARE_HOOK_LIB = os.path.join(ROOT, "build", "bench_ir",
                             f"libbare_hook-{sys.implementation.cache_tag}.so")

GROUPS = ["inputs", "calls", "inputs_dynamic", "linear", "stack", "gpt", "depth", "lookup",
          "instances", "frame_tax", "generate"]
SIDES = ["eager", "ours", "dynamo"]
FRAME_TAX_CALLS = 256   # plain frames per call in the frame_tax group's second point

# Functions whose inclusive instructions make up each system's guard check and entry
# lookup on a hit (see the module docstring), and the object file they live in.
OURS_OBJECT = "nnscaler_eval/_C"
DYNAMO_OBJECT = "libtorch_python"
OURS_GUARD_FUNCTIONS = ["cache_tables_find", "cache_table_find", "call_key_build",
                        "cache_lookup"]
OURS_GUARD_PARTS = {"key": ["call_key_build"], "state guards": ["cache_entry_check"]}
DYNAMO_GUARD_FUNCTIONS = ["lookup"]


# ------------------------------------------------------------------ arithmetic

def per_call(samples: list[tuple[int, float]], per_iteration: int = 1) -> tuple[float, float]:
    """Instructions per call from dumps taken after loops of n iterations, in the order
    they ran: [(n1, Ir), (n2, Ir), (n1, Ir), (n2, Ir), ...].  Each consecutive pair
    (a, b) gives (Ir_b - Ir_a) / (n_b - n_a) / per_iteration.  Returns the median of
    the pairs' figures and the median of their distances from it (with two pairs: the
    mean and half the difference).  A one-off event inside one loop (the allocator
    growing an arena: ~250 k Ir here) moves one pair only, and the median drops it."""
    if len(samples) < 2 or len(samples) % 2:
        raise ValueError(f"need pairs of (n, Ir) samples, got {len(samples)}")
    slopes = []
    for (na, ia), (nb, ib) in zip(samples[::2], samples[1::2]):
        if nb == na:
            raise ValueError("a pair with equal n cancels nothing")
        slopes.append((ib - ia) / (nb - na) / per_iteration)
    middle = statistics.median(slopes)
    return middle, statistics.median(abs(x - middle) for x in slopes)


def parse_dump(text: str) -> tuple[Optional[str], Optional[int]]:
    """(client-request label, total Ir) of one callgrind dump file."""
    label = total = None
    prefix = "desc: Trigger: Client Request: "
    for line in text.splitlines():
        if line.startswith(prefix):
            label = line[len(prefix):].strip()
        elif line.startswith("summary:"):
            total = int(line.split()[1])
        elif line.startswith("totals:") and total is None:
            total = int(line.split()[1])
    return label, total


_CLONE_SUFFIX = re.compile(r"(\.(isra|constprop|part|cold|lto_priv)(\.\d+)?)+$")


def _name_id(value: str, table: dict[str, str]) -> str:
    """The id of a compressed callgrind name, "(12) name" or "(12)", recording the name
    the first time; an uncompressed name is its own id."""
    if value.startswith("("):
        end = value.index(")")
        key = value[1:end]
        if value[end + 1:].strip():
            table[key] = value[end + 1:].strip()
        return key
    table[value] = value
    return value


def inclusive_costs(dump: str, wanted: dict[str, tuple[str, list[str]]]) -> dict[str, int]:
    """Inclusive Ir, in one callgrind dump, of the functions named in `wanted`
    ({figure: (object file substring, [function, ...])}), summed per figure.  A
    function's inclusive cost is its own cost lines plus the inclusive costs of the
    calls it makes (the line after each `calls=`).  GCC's clone suffixes
    (`cache_tables_find.isra.0`) are ignored; recursive activations (`name'2`) are
    inside the outer activation's cost and are not added again.  Figures whose
    functions do not appear are left out."""
    names: dict[str, str] = {}
    objects: dict[str, str] = {}
    fn_object: dict[str, Optional[str]] = {}
    cost: dict[str, int] = {}
    ob = cob = fn = None
    for line in dump.splitlines():
        if not line:
            continue
        first = line[0]
        if first.isdigit() or first in "+-*":
            if fn is not None:
                cost[fn] = cost.get(fn, 0) + int(line.split()[-1])
            continue
        key, eq, value = line.partition("=")
        if not eq:
            continue
        if key == "ob":
            ob = _name_id(value, objects)
        elif key == "cob":
            cob = _name_id(value, objects)
        elif key == "fn":
            fn = _name_id(value, names)
            fn_object.setdefault(fn, ob)
        elif key == "cfn":
            fn_object.setdefault(_name_id(value, names), cob if cob is not None else ob)
        elif key == "calls":
            cob = None
    found: dict[str, int] = {}
    for fid, total in cost.items():
        name = names.get(fid, "")
        if re.search(r"'\d+$", name):
            continue
        name = _CLONE_SUFFIX.sub("", name)
        obj = objects.get(fn_object.get(fid) or "", "")
        for figure, (object_part, functions) in wanted.items():
            if name in functions and object_part in obj:
                found[figure] = found.get(figure, 0) + total
    return found


# ------------------------------------------------------------------ the worker

@dataclasses.dataclass
class Point:
    """One measured configuration of a group: its sides' loops, loop sizes, checks."""
    name: str
    loops: dict[str, Callable[[int], Any]]
    n: tuple[int, int]
    per_iteration: int = 1
    context: Callable[[], Any] = contextlib.nullcontext
    warm: int = 2
    guard_scope: bool = False
    ours: list = dataclasses.field(default_factory=list)   # our compiled modules
    params: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)
    prepare: Callable[[], None] = lambda: None   # run before the point's loops
    captures: int = 1       # graphs ours should hold per module (a note if not)


class Marks:
    """Callgrind client requests through benchmarks/cgmark.c."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(MARK_LIB)
        self.lib.cgmark_dump.argtypes = [ctypes.c_char_p]

    def on_valgrind(self) -> bool:
        return bool(self.lib.cgmark_on_valgrind())

    def start(self) -> None:
        self.lib.cgmark_start()

    def zero(self) -> None:
        self.lib.cgmark_zero()

    def dump(self, label: str) -> None:
        self.lib.cgmark_dump(label.encode())


def _build_helper(src: str, lib: str, flags: list[str], needs: str) -> None:
    """Compile one of the benchmark's C helpers into build/bench_ir/ when it is missing
    or older than its source."""
    if os.path.exists(lib) and os.path.getmtime(lib) >= os.path.getmtime(src):
        return
    os.makedirs(os.path.dirname(lib), exist_ok=True)
    out = subprocess.run(["gcc", "-shared", "-fPIC", "-O1", *flags, "-o", lib, src],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_ir: could not build {os.path.relpath(src, ROOT)} (needs "
                         f"gcc and {needs}):\n" + out.stderr)


def build_marks() -> None:
    """Compile benchmarks/cgmark.c (the client requests) and benchmarks/bare_hook.c (a
    PEP 523 evaluator that only passes frames on, for the frame_tax group)."""
    import sysconfig

    _build_helper(MARK_SRC, MARK_LIB, [], "valgrind's headers, <valgrind/callgrind.h>")
    _build_helper(BARE_HOOK_SRC, BARE_HOOK_LIB, ["-I" + sysconfig.get_paths()["include"]],
                  "this Python's headers")


def _bare_hook_loop(inner: Callable[[int], Any]) -> Callable[[int], Any]:
    """`inner` run with benchmarks/bare_hook.c's evaluator installed around the loop
    (installing and removing it is outside the per-call slope: the same in both loops
    of a pair)."""
    lib = ctypes.PyDLL(BARE_HOOK_LIB)
    lib.bare_hook_install.restype = ctypes.c_int

    def loop(n: int) -> Any:
        if lib.bare_hook_install() != 0:
            raise RuntimeError("bare_hook: another frame evaluator is installed")
        try:
            return inner(n)
        finally:
            lib.bare_hook_uninstall()
    return loop


def _fresh(cls: type, tag: str) -> type:
    """A subclass of `cls` whose forward has a code object of its own: both systems
    cache on code objects, and no two points should share a cache.  The copy keeps the
    name `forward` (`variants.copy_function` renames it): on the commit these figures
    were first taken, ours did not capture a root whose forward's code is named
    otherwise (`forward = _impl` too) and captured its submodules one by one."""
    f = cls.forward
    code = f.__code__.replace()          # equal, but another object
    forward = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__,
                                 f.__closure__)
    forward.__qualname__ = f.__qualname__
    return type(f"{cls.__name__}_{tag}", (cls,), {"forward": forward})


def _loop(fn: Callable[..., Any], *args: Any) -> Callable[[int], Any]:
    from benchmarks.harness import make_loop

    return make_loop(fn, *args)


def _round_robin(fn: Callable[..., Any], xs: list) -> Callable[[int], Any]:
    # One iteration calls every shape once, unrolled: no inner loop in the figure.
    names = [f"x{i}" for i in range(len(xs))]
    src = ("def loop(n, fn=fn, " + ", ".join(f"{v}={v}" for v in names) + "):\n"
           "    for _ in range(n):\n" + "".join(f"        fn({v})\n" for v in names))
    namespace: dict = {"fn": fn, **dict(zip(names, xs))}
    exec(compile(src, "<benchmarks.bench_ir.round_robin>", "exec"), namespace)
    return namespace["loop"]


def _sides(base: Any, call: Callable[[Any], Any], ours_options: Optional[dict] = None,
           dynamic: Any = False, context: Callable[[], Any] = contextlib.nullcontext
           ) -> tuple[dict[str, Any], list]:
    """eager / ours / dynamo copies of `base` with their first calls made (ours checked
    to have captured and hit); returns ({side: compiled}, [ours])."""
    from benchmarks.variants import compile_variant, first_call

    built: dict[str, Any] = {}
    with context():
        for side in SIDES:
            c = compile_variant(base, side, dynamic=dynamic, **(ours_options or {}))
            first_call(side, c, lambda c=c: call(c))
            for _ in range(2):
                call(c)
            built[side] = c
    return built, [built["ours"]]


def _dynamo_direct(compiled: Any, xs: tuple) -> Callable[..., Any]:
    """Dynamo's transformed code for the forward, as a plain function (no eval-frame
    callback, no guards): `fn(m, *xs)` runs its compiled body."""
    from benchmarks.cases.guard_check import dynamo_entry

    m = compiled._orig_mod
    forward = type(m).forward
    fn = types.FunctionType(dynamo_entry(m).code, forward.__globals__, "dynamo_direct")
    import torch
    torch.testing.assert_close(fn(m, *xs), m(*xs))
    return fn


def _with_bodies(point: Point, built: dict[str, Any], xs: tuple) -> None:
    """Adds the sides that run a compiled body without its system's call path:
    'eager body' (the forward function, no nn.Module.__call__), 'ours runner'
    (our cache entry's runner) and 'dynamo code' (Dynamo's transformed code); and
    'ours check_verbose' (`entry.check_verbose()`, what the timed guard_check case
    reports as our state guards)."""
    import torch

    from benchmarks.cases.guard_check import ours_entry, ours_runner

    e, o = built["eager"], built["ours"]
    point.loops["eager body"] = _loop(type(e).forward, e, *xs)
    runner = ours_runner(o)
    torch.testing.assert_close(runner(o, *xs), o(*xs))
    point.loops["ours runner"] = _loop(runner, o, *xs)
    d = built["dynamo"]
    point.loops["dynamo code"] = _loop(_dynamo_direct(d, xs), d._orig_mod, *xs)
    # what the timed guard_check case calls "ours state guards"
    entry = ours_entry(o)
    assert entry.check_verbose() is None, entry.check_verbose()
    point.loops["ours check_verbose"] = _loop(entry.check_verbose)


def adder(k: int) -> Any:
    """A module whose forward(self, x0, ..., x{k-1}) returns x0 + ... + x{k-1} + 1 (k
    adds: with no operation at all Dynamo would make no graph), a class of its own."""
    from torch import nn

    names = [f"x{i}" for i in range(k)]
    namespace: dict = {}
    exec(compile(f"def forward(self, {', '.join(names)}):\n"
                 f"    return {' + '.join(names)} + 1\n", f"<bench_ir adder {k}>", "exec"),
         namespace)
    return type(f"Adder{k}", (nn.Module,), {"forward": namespace["forward"]})()


def group_inputs(quick: bool) -> list[Point]:
    """A forward that adds up 1/4/16/32 tensor arguments (and 1), (1, 8) each, no_grad."""
    import torch

    points = []
    for k in (1, 4, 16, 32):
        base = adder(k)
        xs = tuple(torch.randn(1, 8) for _ in range(k))
        built, ours = _sides(base, lambda c: c(*xs), context=torch.no_grad)
        p = Point(f"{k} input{'s' if k > 1 else ''}",
                  {s: _loop(c, *xs) for s, c in built.items()},
                  (10, 40) if quick else (20, 100), context=torch.no_grad,
                  guard_scope=True, ours=ours, params={"inputs": k}, warm=3)
        with torch.no_grad():
            _with_bodies(p, built, xs)
        points.append(p)
    return points


def group_calls(quick: bool) -> list[Point]:
    """The bare call: a module whose forward returns its first of 1/8/16/32/64 tensor
    arguments ((1, 8) each, no_grad), so that the figure is the call machinery per
    input and nothing else (no body: the adders' allocations move their figures by a
    few thousand instructions between runs).  Dynamo makes no graph of such a frame
    and runs it as it is, after its callback."""
    import torch

    from benchmarks import models

    points = []
    for k in (1, 8, 16, 32, 64):
        base = models.passthrough(k)
        xs = tuple(torch.randn(1, 8) for _ in range(k))
        built, ours = _sides(base, lambda c: c(*xs), context=torch.no_grad)
        points.append(Point(f"{k} input{'s' if k > 1 else ''}, bare",
                            {s: _loop(c, *xs) for s, c in built.items()},
                            (10, 40) if quick else (20, 100), context=torch.no_grad,
                            ours=ours, params={"inputs": k}, warm=3))
    return points


def group_inputs_dynamic(quick: bool) -> list[Point]:
    """group_inputs with every size symbolic: ours `dynamic=True` (the key compared
    outside the symbolic fields, then the shape-guard program), Dynamo `dynamic=True`."""
    import torch

    points = []
    for k in (1, 4, 16, 32):
        base = adder(k)
        xs = tuple(torch.randn(2, 8) for _ in range(k))
        # captured at other sizes, so that every measured hit matches the symbolic
        # fields and runs the shape-guard program (not the exact-key path)
        first = tuple(torch.randn(3, 9) for _ in range(k))
        built, ours = _sides(base, lambda c: c(*first), ours_options={"ours_dynamic": True},
                             dynamic=True, context=torch.no_grad)
        with torch.no_grad():
            for c in built.values():
                c(*xs)
        p = Point(f"{k} input{'s' if k > 1 else ''}, dynamic",
                  {s: _loop(c, *xs) for s, c in built.items()},
                  (10, 40) if quick else (20, 100), context=torch.no_grad,
                  guard_scope=True, ours=ours, params={"inputs": k}, warm=3)
        points.append(p)
    return points


def group_linear(quick: bool) -> list[Point]:
    """nn.Linear(8, 8) itself (torch's module, no user forward), batch 1."""
    import torch
    from torch import nn

    points = []
    for mode, context in (("no_grad", torch.no_grad), ("grad", torch.enable_grad)):
        torch.manual_seed(0)
        x = torch.randn(1, 8)
        built, ours = _sides(nn.Linear(8, 8), lambda c: c(x), context=context)
        points.append(Point(f"nn.Linear(8,8), {mode}",
                            {s: _loop(c, x) for s, c in built.items()},
                            (10, 40) if quick else (20, 100), context=context,
                            ours=ours, params={"grad_mode": mode}, warm=3))
    return points


def group_stack(quick: bool) -> list[Point]:
    """12 Linear(8,8)+ReLU blocks in a ModuleList (benchmarks/models.py Stack), batch 1."""
    import torch

    from benchmarks import models

    points = []
    for mode, context in (("no_grad", torch.no_grad), ("grad", torch.enable_grad)):
        torch.manual_seed(0)
        base = _fresh(models.Stack, f"s12_{mode}")(12)
        x = torch.randn(1, 8)
        built, ours = _sides(base, lambda c: c(x), context=context)
        points.append(Point(f"12-layer Linear+ReLU stack, {mode}",
                            {s: _loop(c, x) for s, c in built.items()},
                            (5, 20) if quick else (10, 50), context=context,
                            ours=ours, params={"grad_mode": mode}))
    return points


def group_gpt(quick: bool) -> list[Point]:
    """The 12-block GPT of benchmarks/models.py (dim 64, seq 16), batch 1: eval() under
    no_grad, and train() with grad on (dropout active; forward only)."""
    import torch

    from benchmarks import models

    gpt, (idx,) = models.build("gpt12", 1)
    points = []
    built: dict[str, Any] = {}
    for mode, context, train in (("no_grad, eval()", torch.no_grad, False),
                                 ("grad, train()", torch.enable_grad, True)):
        if not built:
            gpt.eval()
            built, ours = _sides(gpt, lambda c: c(idx), context=context)
        for c in built.values():
            c.train(train)
        with context():
            from benchmarks.variants import first_call
            first_call("ours", built["ours"], lambda: built["ours"](idx))
            for c in built.values():
                for _ in range(2):
                    c(idx)
        points.append(Point(f"12-block GPT, {mode}",
                            {s: _loop(c, idx) for s, c in built.items()},
                            (1, 2) if quick else (1, 3), context=context, warm=1,
                            guard_scope=True, captures=2,     # one per grad mode; train/eval share it
                            ours=ours, params={"mode": mode},
                            prepare=lambda train=train: [c.train(train)
                                                         for c in built.values()]))
    return points


def nested(depth: int, tag: str) -> Any:
    """`depth` modules, each holding the next one: Level.forward(x) = inner(lin(x)), the
    innermost a Leaf, forward(x) = lin(x); a Linear(8, 8) in each.  Classes of their own
    per tag."""
    from torch import nn

    class Leaf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: Any) -> Any:
            return self.lin(x)

    class Level(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.inner = inner

        def forward(self, x: Any) -> Any:
            return self.inner(self.lin(x))

    m = _fresh(Leaf, f"nested_{tag}")()
    level = _fresh(Level, f"nested_{tag}")
    for _ in range(depth - 1):
        m = level(m)
    return m


def group_depth(quick: bool) -> list[Point]:
    """State-guard depth: the guard_check case's stacks of 1/12/48 Linear+ReLU blocks
    (flat, in a ModuleList) and chains of 1/12/48 nested modules, 1 input, no_grad."""
    import torch

    from benchmarks import models

    sizes = {1: (10, 40) if quick else (20, 100), 12: (3, 10) if quick else (5, 25),
             48: (2, 6) if quick else (3, 13)}
    points = []
    for kind in ("stack", "nested"):
        for depth in (1, 12, 48):
            torch.manual_seed(0)
            base = models.multi_input_stack(depth, 1) if kind == "stack" \
                else nested(depth, f"d{depth}")
            xs = (torch.randn(1, 8),)
            built, ours = _sides(base, lambda c: c(*xs), context=torch.no_grad)
            p = Point(f"{kind}, depth {depth}", {s: _loop(c, *xs) for s, c in built.items()},
                      sizes[depth], context=torch.no_grad, guard_scope=True, ours=ours,
                      params={"kind": kind, "depth": depth}, warm=1 if depth == 48 else 2)
            if kind == "stack":
                with torch.no_grad():
                    _with_bodies(p, built, xs)
            points.append(p)
    return points


def group_lookup(quick: bool) -> list[Point]:
    """1..8 cached input shapes (b, 8), b = 1..k, of one Linear+ReLU block, called
    round-robin: both caches are most-recently-used first, so every call hits the k-th
    entry.  Dynamo with dynamic=False (one entry per shape, like ours)."""
    import torch

    from benchmarks import models
    from benchmarks.variants import nnscaler_module

    points = []
    for k in ((1, 2, 4, 8) if quick else range(1, 9)):
        torch.manual_seed(0)
        base = models.multi_input_stack(1, 1)
        xs = [torch.randn(b, 8) for b in range(1, k + 1)]

        def call(c: Any, xs: list = xs) -> None:
            for x in xs:
                c(x)

        built, ours = _sides(base, call, ours_options={"cache_size_limit": 16},
                             context=torch.no_grad)
        info = nnscaler_module().cache_info(built["ours"])
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        found = len(_debug_get_cache_entry_list(type(base).forward.__code__))
        notes = []
        if info.entries != k:
            notes.append(f"ours holds {info.entries} entries, expected {k}")
        if found != k:
            notes.append(f"Dynamo holds {found} entries, expected {k}")
        points.append(Point(f"{k} entr{'y' if k == 1 else 'ies'}",
                            {s: _round_robin(c, xs) for s, c in built.items()},
                            (3, 10) if quick else (5, 25), per_iteration=k, captures=k,
                            context=torch.no_grad, guard_scope=True, ours=ours,
                            params={"entries": k}, notes=notes))
    return points


def group_instances(quick: bool) -> list[Point]:
    """512 compiled instances of one class (a Linear+ReLU block): calling the 1st
    created against the 512th; and a class with a single instance."""
    import torch

    from benchmarks import models
    from benchmarks.variants import compile_variant, first_call

    x = torch.randn(1, 8)
    points = []
    for count in (1, 512):
        torch.manual_seed(0)
        base = models.multi_input_stack(1, 1)
        per_side: dict[str, list] = {}
        with torch.no_grad():
            for side in SIDES:
                ms = []
                for _ in range(count):
                    c = compile_variant(base, side, dynamic=False)
                    first_call(side, c, lambda c=c: c(x))
                    c(x)
                    ms.append(c)
                per_side[side] = ms
        picks = [("1st", 0)] if count == 1 else [("1st", 0), ("512th", count - 1)]
        for label, i in picks:
            name = "1 instance" if count == 1 else f"{label} of {count} instances"
            points.append(Point(name, {s: _loop(ms[i], x) for s, ms in per_side.items()},
                                (10, 40) if quick else (20, 100), context=torch.no_grad,
                                guard_scope=True, ours=[per_side["ours"][i]],
                                params={"instances": count, "which": i + 1}, warm=3))
        # the other instances stay alive: they are what the lookup walks past
        points[-1].params["_keep"] = per_side
    return points


def plain(x: Any) -> Any:
    """The non-target frame of the frame_tax group."""
    return x


def group_frame_tax(quick: bool) -> list[Point]:
    """A forward hook on a submodule (run at hit time: ours keeps hooks as opaque
    nodes) that calls a plain Python function K times, K = 0 and FRAME_TAX_CALLS; per
    frame = (Ir(K=FRAME_TAX_CALLS) - Ir(K=0)) / FRAME_TAX_CALLS on each side, the tax =
    that minus eager's (K large: a module call moves by ~1 k Ir between runs, which
    must not move a per-frame figure of tens).  One more
    side, 'eager, bare hook': eager with benchmarks/bare_hook.c's evaluator installed,
    which only passes frames on: what any PEP 523 evaluator costs a frame, so that ours
    minus it is our own shim."""
    import torch
    from torch import nn

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: Any) -> Any:
            return self.lin(x)

    class Outer(nn.Module):
        def __init__(self, inner_cls: type) -> None:
            super().__init__()
            self.inner = inner_cls()

        def forward(self, x: Any) -> Any:
            return self.inner(x) + 1

    x = torch.randn(1, 8)
    points = []
    for k in (0, FRAME_TAX_CALLS):
        namespace: dict = {"plain": plain}
        exec(compile("def hook(module, args, out):\n"
                     f"    for _ in range({k}):\n"
                     "        plain(out)\n", f"<frame_tax hook k{k}>", "exec"), namespace)
        torch.manual_seed(0)
        base = _fresh(Outer, f"ft{k}")(_fresh(Inner, f"ft{k}"))
        base.inner.register_forward_hook(namespace["hook"])
        built, ours = _sides(base, lambda c: c(x), context=torch.no_grad)
        loops = {s: _loop(c, x) for s, c in built.items()}
        loops["eager, bare hook"] = _bare_hook_loop(_loop(built["eager"], x))
        points.append(Point(f"hook calling a Python function {k} times", loops,
                            (5, 20) if quick else (10, 50), context=torch.no_grad,
                            ours=ours, params={"frames": k},
                            captures=2))   # the root, and the hooked submodule on its own
    # The other Python an opaque node runs at a hit: a register_op op (ours calls it
    # disarmed too; Dynamo traces into it).
    import nnscaler

    for k in (0, FRAME_TAX_CALLS):
        namespace = {"plain": plain}
        exec(compile("def op(x):\n"
                     f"    for _ in range({k}):\n"
                     "        plain(x)\n"
                     "    return x * 2\n", f"<frame_tax op k{k}>", "exec"), namespace)
        op = nnscaler.register_op("a^ b -> a^ b", name=f"bench_ir_frame_tax_op_{k}")(
            namespace["op"])

        class WithOp(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x: Any, op: Any = op) -> Any:
                return op(self.lin(x)) + 1

        torch.manual_seed(0)
        base = _fresh(WithOp, f"fto{k}")()
        built, ours = _sides(base, lambda c: c(x), context=torch.no_grad)
        loops = {s: _loop(c, x) for s, c in built.items()}
        points.append(Point(f"register_op op calling a Python function {k} times", loops,
                            (5, 20) if quick else (10, 50), context=torch.no_grad,
                            ours=ours, params={"frames": k}))
    return points


GENERATE_TOKENS = 16


def group_generate(quick: bool) -> list[Point]:
    """`generate()` per new token, tiny HF gpt2 and llama (benchmarks/generate_cost.py's
    models), batch 1, an 8-token prompt, 16 new tokens, greedy, no_grad: eager; ours,
    `nnscaler.compile(m)` (two graphs: the prefill, the decode step with the cache's
    tensors as inputs); Dynamo, `m.forward = torch.compile(m.forward, backend="eager")`
    (the graphs of the same forwards).  Every side runs the same generate() loop; the
    figure is one generate() call's instructions over its 16 tokens (the prefill
    included, as a user pays it)."""
    import torch

    from benchmarks.generate_cost import _model, _variants

    points = []
    for name in ("gpt2", "llama"):
        model, ids = _model(name)
        kwargs = dict(max_new_tokens=GENERATE_TOKENS, min_new_tokens=GENERATE_TOKENS,
                      do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
        sides = _variants(model, SIDES)
        with torch.no_grad():
            want = sides["eager"].generate(ids, **kwargs)
            for side, m in sides.items():
                for _ in range(2):
                    assert torch.equal(m.generate(ids, **kwargs), want), side
        loops = {side: _loop(lambda m=m: m.generate(ids, **kwargs)) for side, m in sides.items()}
        points.append(Point(f"generate() per token, tiny {name}", loops, (1, 2),
                            per_iteration=GENERATE_TOKENS, context=torch.no_grad, warm=1,
                            ours=[sides["ours"]], params={"model": name},
                            captures=2))   # the prefill and the decode step
    return points


BUILDERS: dict[str, Callable[[bool], list[Point]]] = {
    "inputs": group_inputs, "calls": group_calls, "inputs_dynamic": group_inputs_dynamic,
    "linear": group_linear, "stack": group_stack,
    "gpt": group_gpt, "depth": group_depth, "lookup": group_lookup,
    "instances": group_instances, "frame_tax": group_frame_tax, "generate": group_generate,
}


def _state(point: Point) -> tuple:
    from torch._dynamo.utils import counters

    from benchmarks.variants import nnscaler_module

    infos = tuple((i.captures, i.misses) for i in
                  (nnscaler_module().cache_info(m) for m in point.ours))
    return infos, int(counters["stats"]["unique_graphs"])


PAIRS = 3     # (N1, N2) pairs per side and point: the figure is their median


def worker(groups: list[str], quick: bool, meta_path: str) -> None:
    """Under callgrind: builds every point of `groups` uninstrumented, then measures
    them; writes what it measured (not the counts: those are in the dumps)."""
    import torch

    from benchmarks.variants import configure_dynamo, nnscaler_module

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    configure_dynamo()
    marks = Marks()
    t0 = time.time()
    print("worker: imports done", flush=True)
    built: list[tuple[str, list[Point], float]] = []
    for group in groups:
        t = time.time()
        built.append((group, BUILDERS[group](quick), time.time() - t))
        print(f"worker: built {group} ({built[-1][2]:.1f} s)", flush=True)
    # No collection during the measurements: one now, the survivors frozen out of
    # the collector's reach, then off (a collection inside one loop and not in its
    # pair would not cancel; a collection under instrumentation is also slow).
    gc.collect()
    gc.freeze()
    gc.disable()
    marks.start()           # instrumentation from here on; counted only between dumps
    out = []
    for group, points, build_seconds in built:
        t_group = time.time()
        for index, p in enumerate(points):
            n1, n2 = p.n
            print(f"worker: {group}: {p.name} ({time.time() - t0:.1f} s)", flush=True)
            p.prepare()
            with p.context():
                before = _state(p)
                for side, loop in p.loops.items():
                    loop(p.warm)
                    for i in range(2 * PAIRS):
                        n = (n1, n2)[i % 2]
                        marks.zero()
                        loop(n)
                        marks.dump(f"{group}|{index}|{side}|{i}|{n}")
                after = _state(p)
            invalid = []
            for m in p.ours:
                info = nnscaler_module().cache_info(m)
                if info.captures != p.captures:
                    p.notes.append(f"ours holds {info.captures} captures, {p.captures} "
                                   f"expected ({info}): not one graph for the forward")
            if after[0] != before[0]:
                invalid.append("ours")
                p.notes.append(f"ours captured or missed during the loops ({before[0]} -> "
                               f"{after[0]}): its figures are not hits")
            if after[1] != before[1]:
                invalid.append("dynamo")
                p.notes.append(f"Dynamo compiled a graph during the loops "
                               f"({before[1]} -> {after[1]})")
            out.append({"group": group, "index": index, "name": p.name, "n": list(p.n),
                        "per_iteration": p.per_iteration, "guard_scope": p.guard_scope,
                        "sides": list(p.loops),
                        "params": {k: v for k, v in p.params.items() if not k.startswith("_")},
                        "notes": p.notes, "invalid": invalid,
                        "ours_cache_info": [str(nnscaler_module().cache_info(m))
                                            for m in p.ours],
                        "build_seconds": round(build_seconds, 1)})
        print(f"worker: {group} measured in {time.time() - t_group:.1f} s", flush=True)
        for entry in out:
            if entry["group"] == group:
                entry["measure_seconds"] = round(time.time() - t_group, 1)
    print(f"worker: done ({time.time() - t0:.1f} s)", flush=True)
    with open(meta_path, "w") as f:
        json.dump({"points": out, "on_valgrind": marks.on_valgrind()}, f)


# ------------------------------------------------------------------ the driver

def run_groups(groups: list[str], quick: bool, work: str, reuse: bool = False) -> dict:
    """Runs the worker for `groups` in one callgrind process and reads its dumps;
    returns {"groups": [...], "seconds": ..., "error": ...}.  With `reuse`, the dumps
    a previous run left in `work` are read again instead."""
    os.makedirs(work, exist_ok=True)
    meta_path = os.path.join(work, "meta.json")
    log_path = os.path.join(work, "valgrind.log")
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONHASHSEED"] = "0"
    env["OMP_NUM_THREADS"] = "1"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
           f"--callgrind-out-file={work}/cg.out", sys.executable, "-m",
           "benchmarks.bench_ir", "--worker", ",".join(groups), "--meta", meta_path]
    if quick:
        cmd.append("--quick")
    t0 = time.time()
    if reuse and os.path.exists(meta_path):
        rc = 0
    else:
        for old in glob.glob(os.path.join(work, "cg.out*")) + [meta_path]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(old)
        print("   " + " ".join(cmd), flush=True)
        with open(log_path, "w") as logf:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=logf,
                                stderr=subprocess.STDOUT).returncode
    seconds = time.time() - t0
    if rc != 0 or not os.path.exists(meta_path):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        return {"error": f"the worker exited with {rc}", "log_tail": tail,
                "seconds": round(seconds, 1), "groups": []}
    with open(meta_path) as f:
        meta = json.load(f)
    dumps: dict[tuple[str, int, str], list[tuple[int, int, int, str]]] = {}
    for path in glob.glob(os.path.join(work, "cg.out.*")):
        with open(path) as f:
            label, total = parse_dump(f.read())
        if label is None or total is None or label.count("|") != 4:
            continue
        group, index, side, i, n = label.split("|")
        dumps.setdefault((group, int(index), side), []).append((int(i), int(n), total, path))
    t_annotate = time.time()
    by_group: dict[str, dict] = {}
    for point in meta["points"]:
        point["ir"] = {}
        for side in point["sides"]:
            rows = sorted(dumps.get((point["group"], point["index"], side), []))
            if len(rows) != 2 * PAIRS:
                point["ir"][side] = {"error": f"{len(rows)} dumps found, {2 * PAIRS} expected"}
                continue
            value, spread = per_call([(n, total) for _, n, total, _ in rows],
                                     point["per_iteration"])
            figure: dict[str, Any] = {"per_call": value, "spread": spread,
                                      "samples": [[n, total] for _, n, total, _ in rows]}
            if point["guard_scope"] and side in ("ours", "dynamo"):
                figure["functions"] = function_figures(
                    side, [(n, path) for _, n, _, path in rows], point["per_iteration"])
            if side in point.get("invalid", []):
                figure["invalid"] = True
            point["ir"][side] = figure
        g = by_group.setdefault(point["group"], {
            "group": point["group"], "points": [], "build_seconds": point["build_seconds"],
            "measure_seconds": point.get("measure_seconds")})
        g["points"].append(point)
    return {"groups": [by_group[g] for g in groups if g in by_group],
            "seconds": round(seconds, 1),
            "annotate_seconds": round(time.time() - t_annotate, 1)}


def function_figures(side: str, dumps: list[tuple[int, str]], per_iteration: int) -> dict:
    """Per-call inclusive Ir of the guard-check functions, by the same N-difference."""
    if side == "ours":
        wanted = {"guard check + lookup": (OURS_OBJECT, OURS_GUARD_FUNCTIONS),
                  **{k: (OURS_OBJECT, v) for k, v in OURS_GUARD_PARTS.items()}}
    else:
        wanted = {"guard check + lookup": (DYNAMO_OBJECT, DYNAMO_GUARD_FUNCTIONS)}
    per_dump = []
    for n, path in dumps:
        with open(path) as f:
            per_dump.append((n, inclusive_costs(f.read(), wanted)))
    figures = {}
    for figure in wanted:
        samples = [(n, costs.get(figure, 0)) for n, costs in per_dump]
        if all(c == 0 for _, c in samples):
            figures[figure] = None      # the functions were not found (renamed? inlined?)
            continue
        value, spread = per_call(samples, per_iteration)
        figures[figure] = {"per_call": value, "spread": spread}
    return figures


def machine() -> dict[str, Any]:
    from benchmarks.run import machine_info

    info = machine_info()
    try:
        info["valgrind"] = subprocess.run(["valgrind", "--version"], capture_output=True,
                                          text=True).stdout.strip()
    except OSError:
        info["valgrind"] = None
    return info


# ------------------------------------------------------------------ derived figures

def _ir(groups: dict, group: str, point: str, side: str) -> Optional[float]:
    for p in groups.get(group, {}).get("points", []):
        if p["name"] == point:
            f = p["ir"].get(side)
            if f and "per_call" in f and not f.get("invalid"):
                return f["per_call"]
    return None


def _fn(groups: dict, group: str, point: str, side: str, figure: str) -> Optional[float]:
    """Inclusive instructions per call of `figure` (a function group of the same-scope
    guard check, e.g. "key") at one point."""
    for p in groups.get(group, {}).get("points", []):
        if p["name"] == point:
            f = ((p["ir"].get(side) or {}).get("functions") or {}).get(figure)
            if f and "per_call" in f:
                return f["per_call"]
    return None


def _sub(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def derive(groups: dict) -> list[dict]:
    """The figures the issue asks for, each with how it is computed."""
    out: list[dict] = []

    def add(name: str, how: str, values: dict[str, Optional[float]]) -> None:
        out.append({"figure": name, "how": how, "values": values})

    for k in (1, 32):
        point = f"{k} input{'s' if k > 1 else ''}"
        body = _ir(groups, "inputs", point, "eager body")
        add(f"hit overhead over the eager body, {k} input{'s' if k > 1 else ''}",
            "Ir of m(*xs) minus Ir of type(m).forward(m, *xs) run eagerly (the body "
            "alone: the adds, no nn.Module.__call__); for eager this is torch's own "
            "module-call machinery, which every side pays",
            {s: _sub(_ir(groups, "inputs", point, s), body) for s in SIDES})
        add(f"hit overhead over its own compiled body, {k} input{'s' if k > 1 else ''}",
            "ours: Ir of m(*xs) minus Ir of our cache entry's runner(m, *xs); dynamo: "
            "minus Dynamo's transformed code called as a plain function (m, *xs)",
            {"ours": _sub(_ir(groups, "inputs", point, "ours"),
                          _ir(groups, "inputs", point, "ours runner")),
             "dynamo": _sub(_ir(groups, "inputs", point, "dynamo"),
                            _ir(groups, "inputs", point, "dynamo code"))})
    add("instructions per tensor input",
        "(hit overhead over the eager body at 32 inputs - at 1 input) / 31; the body's "
        "own adds are outside the overhead",
        {s: (None if a is None or b is None else (a - b) / 31) for s, a, b in (
            (s, _sub(_ir(groups, "inputs", "32 inputs", s), _ir(groups, "inputs", "32 inputs", "eager body")),
             _sub(_ir(groups, "inputs", "1 input", s), _ir(groups, "inputs", "1 input", "eager body")))
            for s in SIDES)})
    bare = {k: f"{k} input{'s' if k > 1 else ''}, bare" for k in (1, 32, 64)}
    for k in (32, 64):
        add(f"instructions per tensor input, bare call, 1 to {k} inputs",
            f"(Ir of the bare call at {k} inputs - at 1 input) / {k - 1}: what each "
            "further tensor argument costs the call itself",
            {s: (None if _sub(_ir(groups, "calls", bare[k], s), _ir(groups, "calls", bare[1], s)) is None
                 else _sub(_ir(groups, "calls", bare[k], s), _ir(groups, "calls", bare[1], s)) / (k - 1))
             for s in SIDES})
    key_32 = _sub(_fn(groups, "inputs", "32 inputs", "ours", "key"),
                  _fn(groups, "inputs", "1 input", "ours", "key"))
    add("key instructions per tensor input",
        "(inclusive call_key_build at 32 inputs - at 1 input) / 31: the per-call key's "
        "cost per tensor (metadata, aliasing, hashing), free of the noise the adds' "
        "bodies put in the figure above (their allocations move by a few k Ir between "
        "runs)",
        {"ours": None if key_32 is None else key_32 / 31})
    for depth in (1, 12, 48):
        point = f"stack, depth {depth}"
        add(f"hit overhead over its own compiled body, stack depth {depth}",
            "as above, on the guard_check case's stack (what its timed 'ours hit "
            "overhead' / 'dynamo hit overhead' rows measure)",
            {"ours": _sub(_ir(groups, "depth", point, "ours"),
                          _ir(groups, "depth", point, "ours runner")),
             "dynamo": _sub(_ir(groups, "depth", point, "dynamo"),
                            _ir(groups, "depth", point, "dynamo code"))})
    k0 = "hook calling a Python function 0 times"
    k64 = f"hook calling a Python function {FRAME_TAX_CALLS} times"
    slopes = {s: (None if _sub(_ir(groups, "frame_tax", k64, s), _ir(groups, "frame_tax", k0, s)) is None
                  else _sub(_ir(groups, "frame_tax", k64, s), _ir(groups, "frame_tax", k0, s))
                  / FRAME_TAX_CALLS)
              for s in SIDES}
    add("one plain Python frame run inside the compiled forward",
        f"(Ir with the hook calling plain() {FRAME_TAX_CALLS} times - with 0 times) / "
        f"{FRAME_TAX_CALLS}", slopes)
    add("shim per non-target frame (tax over eager)",
        "the figure above minus eager's; Dynamo traces the hook into its graph, so no "
        "frame runs there at hit time and its figure is minus one frame, not a tax",
        {s: _sub(slopes[s], slopes["eager"]) for s in ("ours", "dynamo")})
    bare = _sub(_ir(groups, "frame_tax", k64, "eager, bare hook"),
                _ir(groups, "frame_tax", k0, "eager, bare hook"))
    bare = None if bare is None else bare / FRAME_TAX_CALLS
    add("any PEP 523 evaluator per frame (tax over eager)",
        "eager column: eager run under benchmarks/bare_hook.c, an evaluator that only "
        "hands each frame to CPython's (which stops inlining Python-to-Python calls "
        "while one is installed), per frame, minus eager's",
        {"eager": _sub(bare, slopes["eager"])})
    add("our own shim per non-target frame",
        "ours per frame minus the bare evaluator's per frame: what our evaluator adds "
        "to a frame it passes on (the region lookup, the code's state, the decision); "
        "negative since hooks run with the evaluator uninstalled (csrc/hooked_call.c)",
        {"ours": _sub(slopes["ours"], bare)})
    o0 = "register_op op calling a Python function 0 times"
    o256 = f"register_op op calling a Python function {FRAME_TAX_CALLS} times"
    add("one plain Python frame run inside a register_op op",
        f"(Ir with the op calling plain() {FRAME_TAX_CALLS} times - with 0 times) / "
        f"{FRAME_TAX_CALLS}; Dynamo traces the op into its graph",
        {s: (None if _sub(_ir(groups, "frame_tax", o256, s), _ir(groups, "frame_tax", o0, s))
             is None else _sub(_ir(groups, "frame_tax", o256, s),
                               _ir(groups, "frame_tax", o0, s)) / FRAME_TAX_CALLS)
         for s in SIDES})
    first = "1st of 512 instances"
    last = "512th of 512 instances"
    add("512th instance minus 1st (per call)",
        "Ir of calling the 512th compiled instance of one class minus the 1st, all 512 "
        "alive",
        {s: _sub(_ir(groups, "instances", last, s), _ir(groups, "instances", first, s))
         for s in SIDES})
    return out


# ------------------------------------------------------------------ report

def _k(v: Optional[float]) -> str:
    if v is None:
        return "n/a"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.2f} M"
    if a >= 1e4:
        return f"{v / 1e3:.1f} k"
    if a >= 1e3:
        return f"{v / 1e3:.2f} k"
    return f"{v:.0f}"


def _cell(f: Optional[dict]) -> str:
    if not f or "per_call" not in f:
        return "n/a"
    text = _k(f["per_call"])
    if f.get("spread"):
        text += f" ±{_k(f['spread'])}"
    if f.get("invalid"):
        text += " (not a hit: see notes)"
    return text


def _ratio(a: Optional[dict], b: Optional[dict]) -> str:
    if not a or not b or "per_call" not in a or "per_call" not in b or not b["per_call"]:
        return "n/a"
    if a.get("invalid") or b.get("invalid"):
        return "n/a"
    return f"x{a['per_call'] / b['per_call']:.2f}"


def markdown(data: dict) -> str:
    meta = data["meta"]
    groups = {g["group"]: g for g in data["groups"]}
    lines = [f"# Instructions per call (callgrind): {meta['date']}"
             f"{' (quick)' if meta['quick'] else ''}", "",
             "| machine | |", "|---|---|",
             f"| CPU | {meta['cpu_model']} ({meta['cores']} cores) |",
             f"| Python | {meta['python']} |",
             f"| torch | {meta['torch']} (1 thread) |",
             f"| valgrind | {meta['valgrind']} |",
             f"| git commit | {meta['git_commit']} ({meta['git_branch']}"
             f"{', dirty' if meta.get('git_dirty') else ''}) |",
             f"| run time | {meta['seconds']:.0f} s (`{meta['command']}`) |", "",
             "Method (details in `benchmarks/bench_ir.py`): one "
             "`valgrind --tool=callgrind` process, every side built and warmed up "
             "uninstrumented, counters on only around the loops (client requests); per "
             "call = (Ir(N2) - Ir(N1)) / (N2 - N1), from the sequence N1, N2, N1, N2, "
             "N1, N2 after warm-up calls: the median of the three pairs (± = the median "
             "distance of the pairs from it). Sides: `eager` = the module as it is; `ours` = "
             "`nnscaler.compile(m, backend=\"eager\")`; `dynamo` = "
             "`torch.compile(m, backend=\"eager\", dynamic=False)` (recompile limit 64). "
             "Instructions are not time: they ignore cache misses and stalls. Each "
             "figure includes the loop's own iteration (about 40 Ir).", ""]
    lines += ["## Per call", "",
              "| group | point | N1/N2 | eager | ours | dynamo | ours/eager | ours/dynamo |",
              "|---|---|---|---|---|---|---|---|"]
    notes = []
    for name in GROUPS:
        g = groups.get(name)
        if g is None:
            continue
        for p in g["points"]:
            ir = p["ir"]
            lines.append(f"| {name} | {p['name']} | {p['n'][0]}/{p['n'][1]} | "
                         f"{_cell(ir.get('eager'))} | {_cell(ir.get('ours'))} | "
                         f"{_cell(ir.get('dynamo'))} | {_ratio(ir.get('ours'), ir.get('eager'))}"
                         f" | {_ratio(ir.get('ours'), ir.get('dynamo'))} |")
            notes += [f"{name}, {p['name']}: {n}" for n in p.get("notes", [])]
    extra = [(g, p) for g in GROUPS for p in groups.get(g, {}).get("points", [])
             if set(p["sides"]) - set(SIDES)]
    if extra:
        lines += ["", "## Compiled bodies called directly", "",
                  "`eager body` = `type(m).forward(m, *xs)` without `nn.Module.__call__`; "
                  "`ours runner` = our cache entry's runner called as `runner(m, *xs)`; "
                  "`dynamo code` = Dynamo's transformed code called as a plain function "
                  "(no callback, no guards); `ours check_verbose()` = "
                  "`entry.check_verbose()` of our entry, which the timed guard_check "
                  "case reports as \"ours state guards\"; `eager, bare hook` = the eager "
                  "module run under an evaluator that only passes frames on "
                  "(benchmarks/bare_hook.c).", "",
                  "| group | point | eager body | ours runner | dynamo code | "
                  "ours check_verbose() | eager, bare hook |", "|---|---|---|---|---|---|---|"]
        for g, p in extra:
            ir = p["ir"]
            lines.append(f"| {g} | {p['name']} | {_cell(ir.get('eager body'))} | "
                         f"{_cell(ir.get('ours runner'))} | {_cell(ir.get('dynamo code'))} | "
                         f"{_cell(ir.get('ours check_verbose'))} | "
                         f"{_cell(ir.get('eager, bare hook'))} |")
    scoped = [(g, p) for g in GROUPS for p in groups.get(g, {}).get("points", [])
              if p.get("guard_scope")]
    if scoped:
        lines += ["", "## Guard check, same scope on both sides", "",
                  "Inclusive instructions per call of the functions that decide a hit, "
                  "from the same dumps: ours = `cache_tables_find` + `cache_table_find` "
                  "(finding the module's bucket) + `call_key_build` + `cache_lookup`; Dynamo = `lookup` (libtorch_python: every entry's "
                  "guard manager until one passes). Both include the guards on the "
                  "tensor inputs and finding the entry. Parts of ours: the per-call key "
                  "(`call_key_build`) and the state guards (`cache_entry_check`).", "",
                  "| group | point | ours: key | ours: state guards | ours: all | "
                  "dynamo: all | ours/dynamo |", "|---|---|---|---|---|---|---|"]
        for g, p in scoped:
            o = (p["ir"].get("ours") or {}).get("functions") or {}
            d = (p["ir"].get("dynamo") or {}).get("functions") or {}
            lines.append(f"| {g} | {p['name']} | {_cell(o.get('key'))} | "
                         f"{_cell(o.get('state guards'))} | "
                         f"{_cell(o.get('guard check + lookup'))} | "
                         f"{_cell(d.get('guard check + lookup'))} | "
                         f"{_ratio(o.get('guard check + lookup'), d.get('guard check + lookup'))} |")
    lines += ["", "## Derived", "", "| figure | eager | ours | dynamo | how |",
              "|---|---|---|---|---|"]
    for d in data["derived"]:
        v = d["values"]
        cells = [_k(v[s]) if s in v else "" for s in SIDES]
        lines.append(f"| {d['figure']} | {' | '.join(cells)} | {d['how']} |")
    if notes:
        lines += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    lines += ["", f"Time: {meta['seconds']:.0f} s in all; the callgrind process "
              f"{meta.get('valgrind_seconds', 0):.0f} s (start-up and imports under "
              "valgrind included); per group, building (compiles, captures: "
              "uninstrumented) / measuring: " + ", ".join(
                  f"{g['group']} {g['build_seconds']:.0f} / {g['measure_seconds'] or 0:.0f} s"
                  for g in data["groups"]) + "."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_ir",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller N (about half the time)")
    parser.add_argument("--cases", default=",".join(GROUPS),
                        help=f"comma-separated groups, of: {', '.join(GROUPS)}")
    parser.add_argument("--out", default=RESULTS, help="results folder")
    parser.add_argument("--tag", default=None, help="file name stem instead of bench_ir-<date>")
    parser.add_argument("--keep", default=None, help="keep the callgrind files in this folder")
    parser.add_argument("--reuse", action="store_true",
                        help="with --keep: read the dumps a previous run left there "
                             "instead of running the groups again")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--meta", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker.split(","), args.quick, args.meta)
        return 0
    groups = [g.strip() for g in args.cases.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        parser.error(f"unknown case group(s) {unknown}; known: {', '.join(GROUPS)}")
    for tool in ("valgrind", "gcc"):
        if shutil.which(tool) is None:
            print(f"bench_ir: `{tool}` not found (apt-get install valgrind gcc)", file=sys.stderr)
            return 2
    build_marks()
    started = time.time()
    meta = machine()
    meta.update({"date": datetime.date.today().isoformat(), "quick": args.quick,
                 "groups": groups, "command": " ".join(["python -m benchmarks.bench_ir",
                                                        *(argv if argv is not None
                                                          else sys.argv[1:])]).strip()})
    print(f"bench_ir{' (quick)' if args.quick else ''}: {meta['cpu_model']}, Python "
          f"{meta['python']}, torch {meta['torch']}, {meta['valgrind']}", flush=True)
    work = args.keep or tempfile.mkdtemp(prefix="bench_ir-")
    try:
        run = run_groups(groups, args.quick, work, reuse=args.reuse and bool(args.keep))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if run.get("error"):
        print(f"bench_ir: {run['error']}\n{run['log_tail']}", file=sys.stderr)
        return 1
    results = run["groups"]
    meta["valgrind_seconds"] = run["seconds"]
    meta["seconds"] = round(time.time() - started, 1)
    data = {"meta": meta, "groups": results}
    data["derived"] = derive({g["group"]: g for g in results})
    stem = args.tag or f"bench_ir-{meta['date']}{'-quick' if args.quick else ''}"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    text = markdown(data)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {args.out}/{stem}.{{md,json}} in {meta['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
