"""5. Capture time: the first call of a fresh model, each in a fresh process.

An MLP, one transformer block and a 12-layer small GPT (benchmarks/models.py), batch
8, in train() mode with grad enabled (the first step of training; only the forward is
timed, but aot_eager and Inductor compile the backward graph during it).  Each sample
is one forked child of a zygote that has already imported torch, Dynamo, Inductor and
nnscaler (imports are not counted for anyone) and warmed the runtime with an unrelated
op; Inductor gets an empty cache directory (cold compile).  Unit: seconds for the
first call; the ratio divides by eager's first call.  Inductor's cold compiles are
slow on this machine, so they get fewer repeats (see n), and none for the GPT.
"""
from __future__ import annotations

from benchmarks.cases._firstcall import run_matrix
from benchmarks.harness import Row, Settings, finish, set_ratios
from benchmarks.models import MODEL_DESCRIPTIONS
from benchmarks.variants import AOT_EAGER, INDUCTOR, OURS_INDUCTOR, variant_names

NAME = "capture_time"
TITLE = "Capture time: first call in a fresh process (s)"


def plan(settings: Settings) -> tuple[list[str], list[str], dict]:
    if settings.quick:
        return ["mlp", "block"], variant_names(settings), {"default": 3}
    # Cold Inductor compiles are slow on a 2-core machine (a trial run: MLP 17 s, block
    # 37 s, 12-layer GPT 179 s for one train-mode first call): one repeat for the MLP
    # and the block, none for the GPT; aot_eager on the GPT (~12 s) gets 3.
    return (["mlp", "block", "gpt12"], variant_names(settings),
            {"default": settings.repeats, INDUCTOR: 1, OURS_INDUCTOR: 1,
             (AOT_EAGER, "gpt12"): 3, (INDUCTOR, "gpt12"): 0, (OURS_INDUCTOR, "gpt12"): 0})


def run(settings: Settings) -> list[Row]:
    models, variants, repeats = plan(settings)

    def repeats_of(model: str, variant: str) -> int:
        return repeats.get((variant, model), repeats.get(variant, repeats["default"]))

    results = run_matrix(settings, models, variants, repeats_of,
                         {"batch": 8, "mode": "train", "timeout": 900,
                          "steady_calls": 0, "threads": settings.threads})
    rows: list[Row] = []
    for model in models:
        bench_rows = []
        for variant in variants:
            outs = results[(model, variant)]
            row = Row(NAME, f"{model}: first call", variant, "s",
                      params={"model": model, "description": MODEL_DESCRIPTIONS[model],
                              "batch": 8, "mode": "train"})
            errors = [o["error"] for o in outs if "error" in o]
            if errors:
                row.status, row.error = "not available", errors[0]
            elif outs:
                row.samples = [o["first_s"] for o in outs]
                finish(row)
                seconds = sorted(o["second_s"] for o in outs)
                row.params["second_call_s_median"] = seconds[len(seconds) // 2]
                row.params["capture_rss_peak_mib"] = max(o["capture_rss_peak_mib"] for o in outs)
                if "cache_info" in outs[0]:
                    row.params["cache_info"] = outs[0]["cache_info"]
                row.params["dynamo_graphs"] = outs[0].get("dynamo_graphs")
                if len(outs) < settings.repeats:
                    row.note = (f"{len(outs)} repeat(s) only: a cold compile of this variant "
                                "is slow on this machine")
            else:
                row.status = "skipped"
                row.error = ("a cold Inductor compile of this model took about 3 minutes "
                             "in a trial run on this machine; left out of make bench")
            bench_rows.append(row)
        set_ratios(bench_rows, "eager")
        rows += bench_rows
    return rows
