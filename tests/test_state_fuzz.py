"""The state-mutation fuzzer (tests/state_fuzz.py) in the suite: every change of
reachable state, one at a time, on the project's own models, the forwards of
test_state_reads.py, a timm-like model and tiny Hugging Face gpt2 and llama, gives
eager's answer (a recapture or an eager run is fine; a stale hit fails; where eager
raises, the compiled model must raise the same error; and the cache must serve calls).
`make fuzz-state` runs more seeds."""
from __future__ import annotations

import pytest

import state_fuzz

MODELS = state_fuzz.all_models()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_mutation_of_reachable_state_gives_a_stale_hit(name):
    make, inputs = MODELS[name]
    # A seeded sample of at most 800 per model; `make fuzz-state` runs them all, over
    # five seeds.
    # The Hugging Face models offer about 1,500 mutations, most of which recapture
    # (a capture of theirs costs about 100 ms): a seeded sample of 150 there.
    report = state_fuzz.fuzz(make, inputs, mutations=150 if name.startswith("hf_") else 800,
                             seed=0, name=name)
    assert report.tried >= 5, report
    assert not report.stale, "\n".join(report.stale)
    assert report.hits > 0 or name in state_fuzz.RUNS_EAGERLY, report
