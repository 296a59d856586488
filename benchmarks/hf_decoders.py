"""Hugging Face decoders called with the library's defaults (a KV cache made and
returned): is the root captured whole, and the time per call, side by side.

    .venv/bin/python -m benchmarks.hf_decoders [--quick] [--models llama,gpt2,...]

Tiny configs, random weights (nothing is downloaded), `model(input_ids)` with
`use_cache` left at its default, batch 1, 16 tokens, no_grad, eval.  Systems, each on
its own copy of the same weights: eager; ours, `nnscaler.compile(m)`;
`torch.compile(m, backend="eager")` (Dynamo's capture and guards, no kernel
compiler: the same scope as ours).  Per model: whether our root forward is one graph
(`explain()` finds no fallback), and the median thread CPU time per call over rounds
of the systems interleaved in a rotated order; ratios against eager in the same run.
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


def run(names: list[str], rounds: int, calls: int) -> list[str]:
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64
    lines = [f"{'model':9} {'root whole':28} {'eager us':>9} {'ours':>7} {'dynamo':>7}"]
    ratios: dict[str, list[float]] = {"ours": [], "dynamo": []}
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
        with torch.no_grad():
            whole = _root_whole(systems["ours"], ids)
            for model in systems.values():
                for _ in range(3):
                    model(input_ids=ids)
            times: dict[str, list[float]] = {k: [] for k in systems}
            order = list(systems)
            for r in range(rounds):
                for key in order[r % 3:] + order[:r % 3]:
                    model = systems[key]
                    start = time.thread_time()
                    for _ in range(calls):
                        model(input_ids=ids)
                    times[key].append((time.thread_time() - start) / calls)
        med = {k: statistics.median(v) for k, v in times.items()}
        for key in ratios:
            ratios[key].append(med[key] / med["eager"])
        lines.append(f"{name:9} {whole:28} {med['eager'] * 1e6:>9.0f} "
                     f"{med['ours'] / med['eager']:>7.2f} {med['dynamo'] / med['eager']:>7.2f}")
    if ratios["ours"]:
        lines.append(f"{'median':9} {'':28} {'':>9} {statistics.median(ratios['ours']):>7.2f} "
                     f"{statistics.median(ratios['dynamo']):>7.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds of 10 calls, not 9 of 20")
    parser.add_argument("--models", default="", help="comma list (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    names = [n for n in args.models.split(",") if n] or list(_configs())
    rounds, calls = (5, 10) if args.quick else (9, 20)
    print(f"machine: {platform.processor() or platform.machine()}, Python "
          f"{sys.version.split()[0]}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, 1 thread; batch 1, 16 tokens, no_grad, ratios x eager")
    print("\n".join(run(names, rounds, calls)))


if __name__ == "__main__":
    main()
