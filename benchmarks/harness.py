"""Timing machinery shared by every case.

A case builds *variants* (eager, Dynamo, ours, ...) of one workload and hands them to
`measure()`, which times them interleaved: after a warm-up and a calibration of the
loop count per variant, each repeat times every variant once, in an order rotated by
one position per repeat (ABC, BCA, CAB, ...), so that drift of the machine (other
processes, thermal, frequency) spreads over all variants instead of landing on one.

A variant whose set-up raises is reported as "not available" with the exception text;
the other variants still run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time
import traceback
from typing import Any, Callable, Iterable, Optional

# loop(n) runs the workload n times.  A loop that times itself (in another process)
# returns the seconds it measured for the n iterations; others return None.
Loop = Callable[[int], Optional[float]]


class NotAvailable(Exception):
    """A variant cannot run here (feature missing, backend failing, ...)."""


@dataclasses.dataclass
class Settings:
    quick: bool = False
    repeats: int = 7
    min_time: float = 0.05     # seconds one repeat of one variant must last at least
    max_loops: int = 1_000_000
    warmup: int = 3            # calls before calibration (captures and compiles happen here)
    inductor: bool = True      # run the Inductor variants
    threads: int = 1           # torch intra-op threads (torch.set_num_threads)
    clock: str = "thread"      # "thread": CPU time of this thread; "wall": perf_counter

    @classmethod
    def create(cls, quick: bool, repeats: Optional[int] = None,
               threads: Optional[int] = None, clock: Optional[str] = None) -> "Settings":
        s = cls(quick=quick)
        if clock is not None:
            s.clock = clock
        if threads is not None:
            s.threads = threads
        if quick:
            s.min_time = 0.01
            s.inductor = False
        if repeats is not None:
            s.repeats = repeats
        return s


@dataclasses.dataclass
class Stats:
    median: float
    p10: float
    p90: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> "Stats":
        xs = sorted(samples)
        return cls(statistics.median(xs), quantile(xs, 0.10), quantile(xs, 0.90), len(xs))


def quantile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), without numpy."""
    if not sorted_xs:
        return math.nan
    pos = (len(sorted_xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


@dataclasses.dataclass
class Row:
    """One figure of the report: one variant of one sub-benchmark."""
    case: str
    bench: str                     # sub-benchmark label, e.g. "nn.Linear(8,8) grad"
    variant: str
    unit: str                      # "us", "ns", "s", "MiB", "count"
    status: str = "ok"             # "ok" | "not available" | "skipped"
    median: Optional[float] = None
    p10: Optional[float] = None
    p90: Optional[float] = None
    n: int = 0
    loops: int = 0                 # iterations per repeat
    ratio: Optional[float] = None  # median / baseline median in the same process
    baseline: Optional[str] = None
    error: Optional[str] = None
    params: dict = dataclasses.field(default_factory=dict)
    samples: list = dataclasses.field(default_factory=list)
    note: Optional[str] = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


def make_loop(fn: Callable[..., Any], *args: Any) -> Loop:
    """`loop(n)` calling `fn(*args)` n times with as little harness overhead as Python
    allows (the arguments are default parameters: fast locals)."""
    names = [f"a{i}" for i in range(len(args))]
    params = "".join(f", {n}={n}" for n in names)
    src = (f"def loop(n, fn=fn{params}):\n"
           f"    for _ in range(n):\n"
           f"        fn({', '.join(names)})\n")
    namespace: dict = {"fn": fn, **dict(zip(names, args))}
    exec(compile(src, "<benchmarks.harness.make_loop>", "exec"), namespace)
    return namespace["loop"]


CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}
CLOCK_WORDS = {
    "thread": "CPU time of the benchmarking thread (time.thread_time): time the thread "
              "spends descheduled while other processes run is not counted",
    "wall": "wall-clock time (time.perf_counter)",
}
_clock: Callable[[], float] = time.thread_time


def set_clock(name: str) -> None:
    """The clock of every timed loop (and of the hook-tax worker, which gets the name)."""
    global _clock
    _clock = CLOCKS[name]


def time_loop(loop: Loop, n: int) -> float:
    """Seconds per iteration of `loop(n)`; the garbage collector is off meanwhile."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = _clock()
        own = loop(n)
        t1 = _clock()
    finally:
        if gc_was_enabled:
            gc.enable()
    return (own if own is not None else t1 - t0) / n


def run_timed(loop: Loop, n: int) -> float:
    """Seconds `loop(n)` took: its own figure when it times itself (another process),
    else this thread's clock."""
    t0 = _clock()
    own = loop(n)
    elapsed = _clock() - t0
    return own if own is not None else elapsed


def calibrate(loop: Loop, settings: Settings) -> int:
    """Iterations needed for one repeat to last at least `settings.min_time`.  The
    per-iteration time is the fastest of three trials (one stall from another process
    must not shrink the loop), growing n until a trial lasts a tenth of min_time."""
    n = 1
    while True:
        best = math.inf
        for _ in range(3):
            elapsed = run_timed(loop, n)
            best = min(best, elapsed)
            if elapsed >= settings.min_time:
                break          # one long trial is enough: iterations are slow anyway
        if best >= settings.min_time / 10 or n >= settings.max_loops:
            per_iteration = best / n
            return max(1, min(settings.max_loops,
                              math.ceil(settings.min_time / max(per_iteration, 1e-9))))
        n = min(settings.max_loops, n * 10)


def warm_up(loop: Loop, settings: Settings) -> None:
    """Up to `settings.warmup` single calls; fewer when one call is already long (the
    first call captures or compiles; a second one settles caches and allocators)."""
    for i in range(settings.warmup):
        if run_timed(loop, 1) > 4 * settings.min_time and i >= 1:
            return


@dataclasses.dataclass
class Variant:
    """`setup()` returns the loop (building/compiling the variant); it may raise
    NotAvailable or anything else, and the variant is then reported unavailable."""
    name: str
    setup: Callable[[], Loop]
    context: Callable[[], Any] = contextlib.nullcontext   # entered around every timed loop


def measure(case: str, bench: str, variants: Iterable[Variant], settings: Settings,
            unit: str = "us", baseline: Optional[str] = "eager", params: Optional[dict] = None,
            per_iteration: float = 1.0, scale: Optional[float] = None) -> list[Row]:
    """Time `variants` interleaved; one Row per variant.  Samples are seconds per
    iteration divided by `per_iteration` (e.g. frames per call), then multiplied by
    `scale` (default: from `unit`)."""
    scale = scale if scale is not None else UNIT_SCALE[unit]
    variants = list(variants)
    rows: dict[str, Row] = {}
    loops: dict[str, tuple[Variant, Loop, int]] = {}
    for v in variants:
        row = Row(case, bench, v.name, unit, params=dict(params or {}))
        rows[v.name] = row
        try:
            with v.context():
                loop = v.setup()
                warm_up(loop, settings)         # captures / compiles happen here
                n = calibrate(loop, settings)
            loops[v.name] = (v, loop, n)
            row.loops = n
        except NotAvailable as exc:
            row.status, row.error = "not available", error_text(exc)
        except Exception as exc:  # a variant failing must not stop the others
            row.status, row.error = "not available", error_text(exc)
            row.note = _last_frame(exc)
    names = list(loops)
    for r in range(settings.repeats):
        shift = r % max(1, len(names))
        for name in names[shift:] + names[:shift]:
            v, loop, n = loops[name]
            row = rows[name]
            if row.status != "ok":
                continue
            try:
                with v.context():
                    row.samples.append(time_loop(loop, n) / per_iteration * scale)
            except Exception as exc:
                row.status, row.error = "not available", error_text(exc)
                row.note = _last_frame(exc)
    for row in rows.values():
        if row.status == "ok" and row.samples:
            finish(row)
    set_ratios(list(rows.values()), baseline)
    return list(rows.values())


def finish(row: Row) -> Row:
    s = Stats.of(row.samples)
    row.median, row.p10, row.p90, row.n = s.median, s.p10, s.p90, s.n
    return row


def set_ratios(rows: list[Row], baseline: Optional[str]) -> None:
    if baseline is None:
        return
    base = next((r for r in rows if r.variant == baseline and r.status == "ok"), None)
    for row in rows:
        if base is not None and row.status == "ok" and base.median:
            row.ratio = row.median / base.median
            row.baseline = baseline


def derive(minuend: Row, subtrahend: Row, variant: str, note: str) -> Row:
    """A row whose samples are the per-repeat differences minuend - subtrahend (both
    were timed in the same repeat, next to each other)."""
    row = Row(minuend.case, minuend.bench, variant, minuend.unit, params=dict(minuend.params),
              note=note)
    if minuend.status != "ok" or subtrahend.status != "ok":
        bad = minuend if minuend.status != "ok" else subtrahend
        row.status = "not available"
        row.error = f"{bad.variant}: {bad.error}"
        return row
    row.samples = [a - b for a, b in zip(minuend.samples, subtrahend.samples)]
    row.loops = min(minuend.loops, subtrahend.loops)
    return finish(row)


def paired_difference(case: str, bench: str, variant: str, a: Callable[[], Any],
                      b: Callable[[], Any], settings: Settings, note: str,
                      unit: str = "us", params: Optional[dict] = None,
                      context: Callable[[], Any] = contextlib.nullcontext) -> Row:
    """A row of the per-call difference a() - b(), each call timed on its own, a and b
    alternated call by call (ab, ba, ab, ...): a stall or drift of the machine lands
    on both calls of a pair, where two separate loops (`derive`) let it land on one.
    Each repeat runs pairs for at least `settings.min_time` and gives the median of its
    pairs' differences; the row summarises the repeats.  For overheads that are small
    against the calls themselves (a hit path around a long forward)."""
    row = Row(case, bench, variant, unit, params=dict(params or {}), note=note)
    scale = UNIT_SCALE[unit]
    clock = _clock
    try:
        with context():
            for _ in range(max(2, settings.warmup)):
                a()
                b()
            t0 = clock()
            for _ in range(3):
                a()
                b()
            per_pair = max((clock() - t0) / 3, 1e-7)
            pairs = max(5, min(settings.max_loops, math.ceil(settings.min_time / per_pair)))
            row.loops = pairs
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                for _ in range(settings.repeats):
                    diffs = []
                    for i in range(pairs):
                        if i % 2 == 0:
                            t0 = clock()
                            a()
                            t1 = clock()
                            b()
                            t2 = clock()
                            diffs.append((t1 - t0) - (t2 - t1))
                        else:
                            t0 = clock()
                            b()
                            t1 = clock()
                            a()
                            t2 = clock()
                            diffs.append((t2 - t1) - (t1 - t0))
                    row.samples.append(statistics.median(diffs) * scale)
            finally:
                if gc_was_enabled:
                    gc.enable()
    except NotAvailable as exc:
        row.status, row.error = "not available", error_text(exc)
        return row
    except Exception as exc:
        row.status, row.error = "not available", error_text(exc)
        row.note = _last_frame(exc)
        return row
    return finish(row)


def unavailable_rows(case: str, bench: str, variants: Iterable[str], unit: str,
                     exc: BaseException, params: Optional[dict] = None) -> list[Row]:
    return [Row(case, bench, v, unit, status="not available", error=error_text(exc),
                params=dict(params or {})) for v in variants]


def _last_frame(exc: BaseException) -> Optional[str]:
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return None
    f = tb[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


UNIT_SCALE = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}
