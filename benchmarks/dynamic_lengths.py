"""Sequence lengths that vary: captures, total time and per-call time, side by side.

    .venv/bin/python -m benchmarks.dynamic_lengths [--quick] [--no-inductor]

A pass over lengths 8..40 (shuffled, fixed seed), twice, inference (no_grad), batch 2,
on the 12-block GPT of benchmarks/models.py (positions up to 64) and on a tiny Hugging
Face llama built from its config (`use_cache=False`).  Each system gets a fresh copy of
the same weights:
- eager PyTorch;
- ours: `nnscaler.compile(m)` (automatic dynamic, the default) and
  `nnscaler.compile(m, dynamic=False)` (every length captured);
- `torch.compile(m, backend="eager")` and `torch.compile(m)` (Inductor), automatic
  dynamic, Dynamo's `recompile_limit` raised so that nothing falls back for good.
Reported per system: graphs captured (ours: `cache_info().captures`; Dynamo: graphs a
counting backend received, or frames compiled for Inductor), the time of each pass
(first pass includes every capture and compile), and the steady per-call time:
medians over rounds of every length, the systems of a round interleaved in a rotated
order, on the thread's CPU time.  Ratios against eager within the same run.
"""

from __future__ import annotations

import argparse
import copy
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable

import torch

import nnscaler
from benchmarks import models


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.GPT(models.GPTConfig(layers=12, seq=64)).eval()


def _llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                      intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config).eval()


class Counting:
    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1
        return gm.forward


def _systems(base: torch.nn.Module, inductor: bool) -> dict[str, tuple[Any, Callable[[], int]]]:
    out: dict[str, tuple[Any, Callable[[], int]]] = {}
    eager = copy.deepcopy(base)
    out["eager"] = (eager, lambda: 0)
    ours = nnscaler.compile(copy.deepcopy(base), cache_size_limit=64)
    out["ours"] = (ours, lambda m=ours: nnscaler.cache_info(m).captures)
    static = nnscaler.compile(copy.deepcopy(base), dynamic=False, cache_size_limit=64)
    out["ours dynamic=False"] = (static, lambda m=static: nnscaler.cache_info(m).captures)
    counting = Counting()
    dyn_eager = torch.compile(copy.deepcopy(base), backend=counting)
    out["torch.compile(eager)"] = (dyn_eager, lambda c=counting: c.graphs)
    if inductor:
        frames = Counting()

        def inductor_backend(gm: Any, example_inputs: Any, _frames: Counting = frames) -> Any:
            from torch._inductor.compile_fx import compile_fx
            _frames.graphs += 1
            return compile_fx(gm, example_inputs)

        out["torch.compile()"] = (torch.compile(copy.deepcopy(base), backend=inductor_backend),
                                  lambda c=frames: c.graphs)
    return out


def _call(model: Any, ids: torch.Tensor, hf: bool) -> Any:
    return model(input_ids=ids, use_cache=False) if hf else model(ids)


def run_model(name: str, base: torch.nn.Module, hf: bool, rounds: int,
              inductor: bool) -> list[str]:
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.reset()
    systems = _systems(base, inductor)
    lengths = list(range(8, 41))
    random.Random(0).shuffle(lengths)
    inputs = {L: torch.randint(0, 512, (2, L)) for L in lengths}
    passes: dict[str, list[float]] = {k: [] for k in systems}
    with torch.no_grad():
        for _ in range(2):
            for label, (model, _) in systems.items():
                start = time.perf_counter()
                for L in lengths:
                    _call(model, inputs[L], hf)
                passes[label].append(time.perf_counter() - start)
        # steady state: every length per round, systems rotated
        per_call: dict[str, list[float]] = {k: [] for k in systems}
        labels = list(systems)
        for r in range(rounds):
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            for label in order:
                model = systems[label][0]
                start = time.thread_time()
                for L in lengths:
                    _call(model, inputs[L], hf)
                per_call[label].append((time.thread_time() - start) / len(lengths))
    eager_call = statistics.median(per_call["eager"])
    lines = [f"\n{name}: lengths 8..40 shuffled, batch 2, no_grad, two passes",
             f"{'system':24} {'graphs':>6} {'pass 1 s':>9} {'pass 2 s':>9} "
             f"{'per call ms':>12} {'x eager':>8}"]
    for label, (_, graphs) in systems.items():
        call = statistics.median(per_call[label])
        lines.append(f"{label:24} {graphs():>6} {passes[label][0]:>9.3f} "
                     f"{passes[label][1]:>9.3f} {call * 1e3:>12.3f} {call / eager_call:>8.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 steady rounds, not 9")
    parser.add_argument("--no-inductor", action="store_true",
                        help="leave torch.compile() (Inductor) out: its compiles take minutes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 3 if args.quick else 9
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"Python {sys.version.split()[0]}, torch {torch.__version__}, 1 thread")
    lines = run_model("12-block GPT", _gpt(), False, rounds, not args.no_inductor)
    try:
        lines += run_model("tiny HF llama (2 layers, dim 64)", _llama(), True, rounds,
                           not args.no_inductor)
    except ImportError as exc:
        lines.append(f"\nHF llama: skipped ({exc})")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
