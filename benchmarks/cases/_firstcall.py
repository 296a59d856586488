"""Shared by capture_time and memory: a matrix of first-call jobs run in forked
children of the zygote (benchmarks/zygote.py), interleaved across repeats."""
from __future__ import annotations

from typing import Any, Callable, Optional

from benchmarks.harness import Settings
from benchmarks.zygote import Zygote

_shared: Optional[Zygote] = None


def shared_zygote() -> Zygote:
    """One zygote for the whole run (starting one costs the imports: seconds)."""
    global _shared
    if _shared is None or _shared.proc.poll() is not None:
        _shared = Zygote()
    return _shared


def close_shared() -> None:
    global _shared
    if _shared is not None:
        _shared.close()
        _shared = None


def run_matrix(settings: Settings, models: list[str], variants: list[str],
               repeats_of: Callable[[str, str], int], job_extra: dict,
               log: Callable[[str], None] = print) -> dict[tuple[str, str], list[dict]]:
    """results[(model, variant)] = [child result dict per repeat].  Repeat r runs every
    (model, variant) that still needs a sample, variant order rotated by r."""
    results: dict[tuple[str, str], list[dict]] = {(m, v): [] for m in models for v in variants}
    max_repeats = max(repeats_of(m, v) for m in models for v in variants)
    zygote = shared_zygote()
    for r in range(max_repeats):
        shift = r % len(variants)
        order = variants[shift:] + variants[:shift]
        for model in models:
            for variant in order:
                if len(results[(model, variant)]) >= repeats_of(model, variant):
                    continue
                if any("error" in done for done in results[(model, variant)]):
                    continue         # failed once: the reason is already recorded
                job: dict[str, Any] = {"model": model, "variant": variant, **job_extra}
                out = zygote.run(job)
                results[(model, variant)].append(out)
                if "error" in out:
                    log(f"   {model} / {variant}: {out['error']}")
    return results
