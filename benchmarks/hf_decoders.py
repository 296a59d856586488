"""Hugging Face decoders called with the library's defaults (a KV cache made and
returned), or a decode step (a cache passed in): is the root captured whole, and the
time per call, side by side.

    .venv/bin/python -m benchmarks.hf_decoders [--quick] [--decode] [--inductor]
        [--models llama,gpt2,...]

Tiny configs, random weights (nothing is downloaded), `model(input_ids)` with
`use_cache` left at its default, batch 1, 16 tokens, no_grad, eval.  Systems, each on
its own copy of the same weights: eager; ours, `nnscaler.compile(m)`;
`torch.compile(m, backend="eager")` (Dynamo's capture and guards, no kernel
compiler: the same scope as ours); with --inductor, `torch.compile(m)` too.  Per
model: whether our root forward is one graph (`explain()` finds no fallback), and the
median thread CPU time per call over rounds of the systems interleaved in a rotated
order; ratios against eager in the same run.  With --decode the call is one decode
step, `model(input_ids=token, past_key_values=cache)`, the cache a copy (made before
the clock starts) of the 16-token prompt's; the systems warm up on lengths 16 and 17,
so each has captured or compiled its decode step with dynamic sizes.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch

import nnscaler

_KW = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=64)


def _configs() -> dict[str, Callable[[], Any]]:
    import transformers as t

    causal = t.AutoModelForCausalLM.from_config
    return {
        "llama": lambda: causal(t.LlamaConfig(num_key_value_heads=2, **_KW)),
        "mistral": lambda: causal(t.MistralConfig(num_key_value_heads=2, **_KW)),
        "qwen2": lambda: causal(t.Qwen2Config(num_key_value_heads=2, **_KW)),
        "qwen3": lambda: causal(t.Qwen3Config(num_key_value_heads=2, head_dim=8, **_KW)),
        "gemma": lambda: causal(t.GemmaConfig(num_key_value_heads=2, head_dim=8, **_KW)),
        "phi": lambda: causal(t.PhiConfig(**_KW)),
        "opt": lambda: causal(t.OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, ffn_dim=64,
                                          word_embed_proj_dim=32)),
        "gpt2": lambda: causal(t.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4)),
        "bloom": lambda: causal(t.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2,
                                              n_head=4)),
        "falcon": lambda: causal(t.FalconConfig(vocab_size=128, hidden_size=32,
                                                num_hidden_layers=2, num_attention_heads=4)),
    }


def _root_whole(compiled: torch.nn.Module, ids: torch.Tensor) -> str:
    report = nnscaler.explain(compiled, input_ids=ids)
    if report.fallbacks:
        return f"no: {report.fallbacks[0].reason[:24]}"
    return "yes"


def _timed_call(model: torch.nn.Module, ids: torch.Tensor, decode: Any) -> Callable[[], float]:
    """One call, its thread CPU time in seconds (a decode step's cache copied first,
    off the clock)."""
    if decode is None:
        def call() -> float:
            start = time.thread_time()
            model(input_ids=ids)
            return time.thread_time() - start
        return call
    token, cache = decode

    def step() -> float:
        mine = copy.deepcopy(cache)
        start = time.thread_time()
        model(input_ids=token, past_key_values=mine)
        return time.thread_time() - start
    return step


def run(names: list[str], rounds: int, calls: int, decode: bool = False,
        inductor: bool = False) -> list[str]:
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64
    systems_names = ["ours", "dynamo"] + (["inductor"] if inductor else [])
    lines = [f"{'model':9} {'root whole':28} {'eager us':>9} "
             + " ".join(f"{k:>8}" for k in systems_names)]
    ratios: dict[str, list[float]] = {k: [] for k in systems_names}
    configs = _configs()
    for name in names:
        torch.manual_seed(0)
        try:
            eager = configs[name]().eval()
        except Exception as exc:  # an architecture this transformers lacks
            lines.append(f"{name:9} skipped ({type(exc).__name__}: {exc})")
            continue
        ids = torch.randint(0, 128, (1, 16))
        systems = {"eager": eager,
                   "ours": nnscaler.compile(copy.deepcopy(eager)),
                   "dynamo": torch.compile(copy.deepcopy(eager), backend="eager")}
        if inductor:
            systems["inductor"] = torch.compile(copy.deepcopy(eager))
        with torch.no_grad():
            step = None
            if decode:
                token = torch.randint(0, 128, (1, 1))
                step = (token, eager(input_ids=ids).past_key_values)
                whole = "yes"
                report = nnscaler.explain(systems["ours"], input_ids=token,
                                          past_key_values=copy.deepcopy(step[1]))
                if report.fallbacks:
                    whole = f"no: {report.fallbacks[0].reason[:24]}"
            else:
                whole = _root_whole(systems["ours"], ids)
            calls_of = {k: _timed_call(m, ids, step) for k, m in systems.items()}
            for key, model in systems.items():
                for length in (16, 17, 16):   # two cache lengths: dynamic decode steps
                    prompt = torch.randint(0, 128, (1, length))
                    cache = eager(input_ids=prompt).past_key_values if decode else None
                    for _ in range(2):
                        if decode:
                            model(input_ids=token, past_key_values=copy.deepcopy(cache))
                        else:
                            model(input_ids=ids)
            times: dict[str, list[float]] = {k: [] for k in systems}
            order = list(systems)
            for r in range(rounds):
                for key in order[r % len(order):] + order[:r % len(order)]:
                    call = calls_of[key]
                    times[key].append(sum(call() for _ in range(calls)) / calls)
        med = {k: statistics.median(v) for k, v in times.items()}
        for key in ratios:
            ratios[key].append(med[key] / med["eager"])
        lines.append(f"{name:9} {whole:28} {med['eager'] * 1e6:>9.0f} "
                     + " ".join(f"{med[k] / med['eager']:>8.2f}" for k in systems_names))
    if ratios["ours"]:
        lines.append(f"{'median':9} {'':28} {'':>9} "
                     + " ".join(f"{statistics.median(ratios[k]):>8.2f}" for k in systems_names))
        lines.append(f"{'max':9} {'':28} {'':>9} "
                     + " ".join(f"{max(ratios[k]):>8.2f}" for k in systems_names))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds of 10 calls, not 9 of 20")
    parser.add_argument("--models", default="", help="comma list (default: all)")
    parser.add_argument("--decode", action="store_true",
                        help="time a decode step (a cache passed in), not the prompt")
    parser.add_argument("--inductor", action="store_true", help="add torch.compile(m)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    names = [n for n in args.models.split(",") if n] or list(_configs())
    rounds, calls = (5, 10) if args.quick else (9, 20)
    print(f"machine: {platform.processor() or platform.machine()}, Python "
          f"{sys.version.split()[0]}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, 1 thread; batch 1, "
          f"{'a decode step after 16 tokens' if args.decode else '16 tokens'}, no_grad, "
          "ratios x eager")
    print("\n".join(run(names, rounds, calls, args.decode, args.inductor)))


if __name__ == "__main__":
    main()
