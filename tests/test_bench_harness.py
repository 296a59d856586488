"""Smoke test of the benchmark harness (benchmarks/): the machinery runs end to end
with one repeat on tiny sizes and writes its report.  No timing is asserted
(benchmarks are not tests); it passes whether or not capture works yet, since a
variant that cannot run is reported "not available"."""
from __future__ import annotations

import json
import pathlib

import pytest

from benchmarks import harness, report
from benchmarks.harness import NotAvailable, Settings, Variant, make_loop, measure


def test_measure_reports_unavailable_variants_and_keeps_the_others():
    settings = Settings(repeats=2, min_time=0.0005, warmup=1)

    def broken() -> harness.Loop:
        raise NotAvailable("feature missing")

    rows = measure("smoke", "add", [
        Variant("eager", lambda: make_loop(lambda a, b: a + b, 1, 2)),
        Variant("other", lambda: make_loop(lambda a, b: a * b, 3, 4)),
        Variant("ours", broken),
    ], settings)
    by_name = {r.variant: r for r in rows}
    assert by_name["eager"].status == "ok" and by_name["eager"].n == 2
    assert by_name["eager"].p10 <= by_name["eager"].median <= by_name["eager"].p90
    assert by_name["other"].ratio is not None
    assert by_name["ours"].status == "not available"
    assert "feature missing" in by_name["ours"].error
    assert "not available" in report.one_line(by_name["ours"])


def test_loops_that_time_themselves_calibrate_on_their_own_figure():
    # A loop run in another process returns its own seconds; this thread's CPU clock
    # barely moves meanwhile, and calibration must not grow n without bound.
    settings = Settings(repeats=2, min_time=0.01, warmup=1)
    harness.set_clock("thread")
    assert harness.calibrate(lambda n: n * 1e-3, settings) == 10
    rows = measure("smoke", "remote", [Variant("eager", lambda: (lambda n: n * 1e-3))],
                   settings, unit="ms")
    assert rows[0].median == pytest.approx(1.0)


def test_quantiles_and_derived_rows():
    assert harness.quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    a = harness.finish(harness.Row("c", "b", "a", "us", samples=[5.0, 6.0, 7.0]))
    b = harness.finish(harness.Row("c", "b", "b", "us", samples=[1.0, 1.0, 2.0]))
    d = harness.derive(a, b, "a - b", "difference")
    assert d.samples == [4.0, 5.0, 5.0] and d.median == 5.0


def test_run_two_cases_end_to_end(tmp_path: pathlib.Path):
    from benchmarks import run

    rc = run.main(["--quick", "--repeats", "1", "--min-time", "0.0005",
                   "--only", "lookup", "--only", "recaptures",
                   "--out", str(tmp_path), "--tag", "smoke"])
    assert rc == 0
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert data["meta"]["torch"] and data["meta"]["cpu_model"]
    cases = {r["case"] for r in data["rows"]}
    assert cases == {"lookup", "recaptures"}
    eager = [r for r in data["rows"] if r["case"] == "lookup" and r["variant"] == "eager"]
    assert eager and all(r["status"] == "ok" for r in eager)
    ours = [r for r in data["rows"] if r["variant"] == "ours"]
    assert ours and all(r["status"] in ("ok", "not available") for r in ours)
    text = (tmp_path / "smoke.md").read_text()
    assert "## Headline" in text and "Lookup among N cached shapes" in text
    assert list(tmp_path.glob("smoke-*.png"))


# --- benchmarks/bench_ir.py: the arithmetic that turns callgrind dumps into figures ---

def test_bench_ir_n_difference_cancels_what_is_outside_the_loop():
    from benchmarks.bench_ir import per_call

    # Ir(n) = 5000 (set-up, client requests) + 300 n, for n = 10, 40, 10, 40, 10, 40
    samples = [(n, 5000 + 300 * n) for n in (10, 40) * 3]
    assert per_call(samples) == (300.0, 0.0)
    # a round-robin loop making 4 calls per iteration
    assert per_call(samples, per_iteration=4) == (75.0, 0.0)
    # with two pairs: their mean, and half their difference
    assert per_call([(10, 3000), (40, 12000), (10, 3100), (40, 12700)]) == (310.0, 10.0)


def test_bench_ir_median_drops_a_one_off_event_in_one_loop():
    from benchmarks.bench_ir import per_call

    samples = [(10, 3000), (40, 12000), (10, 3000), (40, 12000 + 250_000),
               (10, 3000), (40, 12030)]
    value, spread = per_call(samples)
    assert value == 301.0 and spread == 1.0
    with pytest.raises(ValueError):
        per_call([(10, 1), (10, 2)])
    with pytest.raises(ValueError):
        per_call([(10, 1), (40, 2), (10, 3)])


def test_bench_ir_reads_callgrind_dumps():
    from benchmarks.bench_ir import inclusive_costs, parse_dump

    # The callgrind format with compressed names: costs after fn= are the function's
    # own; the line after calls= is the inclusive cost of that call.
    dump = """# callgrind format
version: 1
part: 3

desc: I1 cache: 
desc: Trigger: Client Request: inputs|0|ours|3|40

positions: line
events: Ir
summary: 438329

ob=(1) /w/nnscaler_eval/_C.so
fl=(1) /w/guards/cache.c
fn=(1) cache_lookup
0 100
cfn=(2) cache_entry_check
calls=2 0
0 400
+2 10
fi=(2) /usr/include/python3.11/object.h
+1 5
fe=(1)
cfn=(3) cache_lookup'2
calls=1 0
0 50
fn=(3)
0 50
fn=(2)
0 400
fl=(3) /w/csrc/dispatch.c
fn=(4) config_buckets.isra.0
0 70
ob=(2) /v/torch/lib/libtorch_python.so
fl=(4) ???
fn=(5) lookup
0 900
ob=(3) /usr/lib/libother.so
fn=(6) lookup
0 7
totals: 441947
"""
    assert parse_dump(dump) == ("inputs|0|ours|3|40", 438329)
    wanted = {"ours": ("nnscaler_eval/_C", ["cache_lookup", "config_buckets"]),
              "state": ("nnscaler_eval/_C", ["cache_entry_check"]),
              "dynamo": ("libtorch_python", ["lookup"]),
              "missing": ("nnscaler_eval/_C", ["cache_find_bucket"])}
    # cache_lookup: 100 + 400 (its call) + 10 + 5 (inlined code) + 50 (its recursion);
    # the recursive activation is not added again; the clone suffix is ignored
    assert inclusive_costs(dump, wanted) == {"ours": 565 + 70, "state": 400, "dynamo": 900}


def test_paired_difference_subtracts_b_from_a_in_both_orders(monkeypatch):
    # A fake clock that only a() and b() move: a costs 5 s, b 2 s, whichever runs first.
    now = [0.0]

    def a():
        now[0] += 5.0

    def b():
        now[0] += 2.0

    monkeypatch.setattr(harness, "_clock", lambda: now[0])
    row = harness.paired_difference("smoke", "pair", "a - b", a, b,
                                    Settings(repeats=3, min_time=60.0, warmup=1),
                                    note="fake clock", unit="s")
    assert row.status == "ok" and row.samples == [3.0, 3.0, 3.0] and row.loops == 9
