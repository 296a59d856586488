"""8. Memory: what capture and the steady state cost in memory.

In forked children of the zygote (see capture_time), batch 8, train() with grad:
- capture, Python heap peak: tracemalloc's peak during the first call (Python-level
  allocations only: graphs, guards, generated code; not tensor storage);
- capture, RSS peak: peak resident set (VmHWM, reset just before) during the first
  call, minus the resident set before it (tensors, compiled code, everything);
- retained after capture, Python heap: tracemalloc's current size after the first two
  calls and a gc.collect() (what the compiled artefacts keep alive);
- steady state, RSS peak: VmHWM during 10 more calls minus VmRSS before them;
- steady state, RSS growth: VmRSS after those calls minus before (a leak shows here).
tracemalloc slows the first call, so no timing comes from these runs.  Unit: MiB.
Memory figures hardly vary between runs (identical to 3 digits in trials): 2 repeats,
1 for the slow ones (Inductor, aot_eager on the GPT) and in --quick.
"""
from __future__ import annotations

from benchmarks.cases._firstcall import run_matrix
from benchmarks.harness import Row, Settings, finish
from benchmarks.models import MODEL_DESCRIPTIONS
from benchmarks.variants import AOT_EAGER, INDUCTOR, OURS_INDUCTOR, variant_names

NAME = "memory"
TITLE = "Memory during capture and in steady state (MiB)"

METRICS = {
    "capture_py_peak_mib": "capture, Python heap peak",
    "capture_rss_peak_mib": "capture, RSS peak",
    "retained_py_mib": "retained after capture, Python heap",
    "steady_rss_peak_mib": "steady state, RSS peak",
    "steady_rss_growth_mib": "steady state, RSS growth",
}


def run(settings: Settings) -> list[Row]:
    if settings.quick:
        models, repeats = ["mlp"], 1
    else:
        models, repeats = ["mlp", "gpt12"], 2
    variants = variant_names(settings)

    def repeats_of(model: str, variant: str) -> int:
        if variant in (INDUCTOR, OURS_INDUCTOR):
            return 0 if model == "gpt12" else 1
        if variant == AOT_EAGER and model == "gpt12":
            return 1          # ~40 s under tracemalloc
        return repeats

    results = run_matrix(settings, models, variants, repeats_of,
                         {"batch": 8, "mode": "train", "memory": True, "steady_calls": 10,
                          "timeout": 900, "threads": settings.threads})
    rows: list[Row] = []
    for model in models:
        for key, label in METRICS.items():
            for variant in variants:
                outs = results[(model, variant)]
                row = Row(NAME, f"{model}: {label}", variant, "MiB",
                          params={"model": model, "description": MODEL_DESCRIPTIONS[model],
                                  "metric": key})
                errors = [o["error"] for o in outs if "error" in o]
                if errors:
                    row.status, row.error = "not available", errors[0]
                elif not outs:
                    row.status = "skipped"
                    row.error = "Inductor's cold compile of this model takes minutes here"
                else:
                    row.samples = [o[key] for o in outs if key in o]
                    if row.samples:
                        finish(row)
                    else:
                        row.status, row.error = "not available", f"{key} not measured"
                rows.append(row)
    return rows
