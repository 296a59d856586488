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
