"""The state-mutation fuzzer (tests/state_fuzz.py) in the suite: every change of
reachable state, one at a time, on the project's own models, the forwards of
test_state_reads.py, a timm-like model and tiny Hugging Face gpt2 and llama, gives
eager's answer (a recapture or an eager run is fine; a stale hit fails).
`make fuzz-state` runs more seeds."""
from __future__ import annotations

import pytest

import state_fuzz

MODELS = state_fuzz.all_models()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_mutation_of_reachable_state_gives_a_stale_hit(name):
    make, inputs = MODELS[name]
    # A seeded sample of at most 800 per model (the Hugging Face models offer about
    # 1,500, at 20 ms each); `make fuzz-state` runs them all, over five seeds.
    report = state_fuzz.fuzz(make, inputs, mutations=800, seed=0, name=name)
    assert report.tried >= 5, report
    assert not report.stale, "\n".join(report.stale)
