"""generate() per token: tiny HF gpt2 or llama with a KV cache, ours vs eager vs
`torch.compile(backend="eager")` (and, with --inductor, `torch.compile()`), in one process.

    python -m benchmarks.generate_cost [--model gpt2|llama] [--tokens 32] [--repeats 9]
    python -m benchmarks.generate_cost --variant ours --calls N   # one variant, for
        # callgrind: run it for two N under valgrind and divide the difference of the
        # instruction totals by the difference of N x tokens (README, "instructions")

What is timed: `model.generate(ids, max_new_tokens=T, do_sample=False)` under
`torch.no_grad()`, batch 1, an 8-token prompt, after two warm-up calls (captures and
compiles happen there); thread CPU time per call divided by T, median over repeats,
the variants interleaved in an order rotated per repeat. Each variant has its own deep
copy of the same weights. Every variant runs the same generate() loop: only how the
model's forward runs differs (ours: the prefill's graph and the decode step's graph,
the cache's tensors their inputs; Dynamo: its graphs with the cache as inputs;
Inductor: those graphs compiled to kernels).
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
import warnings
from typing import Any, Callable

import torch


def _model(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers
    transformers.logging.set_verbosity_error()
    if name == "gpt2":
        cfg: Any = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                           n_positions=128)
    else:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return model, torch.randint(1, 64, (1, 8))


def _variants(model: torch.nn.Module, names: list[str]) -> dict[str, torch.nn.Module]:
    import nnscaler
    out: dict[str, torch.nn.Module] = {}
    for name in names:
        m = copy.deepcopy(model)
        if name == "ours":
            m = nnscaler.compile(m)
        elif name == "dynamo":
            m.forward = torch.compile(m.forward, backend="eager")
        elif name == "inductor":
            m.forward = torch.compile(m.forward)
        out[name] = m
    return out


def _generate(model: torch.nn.Module, ids: torch.Tensor, tokens: int) -> Callable[[], Any]:
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                  pad_token_id=0, attention_mask=torch.ones_like(ids))
    return lambda: model.generate(ids, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--inductor", action="store_true",
                        help="add torch.compile() (Inductor; minutes of compiling)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--variant", choices=["eager", "ours", "dynamo", "inductor"],
                        help="run only this one, --calls times (for callgrind)")
    parser.add_argument("--calls", type=int, default=2)
    options = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    model, ids = _model(options.model)
    names = ([options.variant] if options.variant else
             ["eager", "ours", "dynamo"] + (["inductor"] if options.inductor else []))
    models = _variants(model, names)
    runs = {name: _generate(m, ids, options.tokens) for name, m in models.items()}
    with torch.no_grad():
        for run in runs.values():   # captures, compiles
            run()
            run()
        if options.variant:
            for _ in range(options.calls):
                runs[options.variant]()
            return
        want = runs["eager"]().tolist()
        for name, run in runs.items():
            assert run().tolist() == want, f"{name} generated other tokens than eager"
        if "ours" in runs:
            import nnscaler
            info = nnscaler.cache_info(models["ours"])
            print(f"# ours: {info.captures} captures, {info.fallbacks} fallbacks")
        samples: dict[str, list[float]] = {name: [] for name in runs}
        order = list(runs)
        for r in range(options.repeats):
            for name in order[r % len(order):] + order[:r % len(order)]:
                start = time.thread_time_ns()
                runs[name]()
                samples[name].append((time.thread_time_ns() - start) / options.tokens / 1e3)
    print(f"# generate() per token, tiny {options.model} (2 layers, width 32), batch 1, prompt 8, "
          f"{options.tokens} new tokens; {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, torch {torch.__version__}")
    base = statistics.median(samples["eager"])
    print("| variant | us/token (median) | p10-p90 | / eager |")
    print("|---|---|---|---|")
    for name, values in samples.items():
        values = sorted(values)
        lo, hi = values[len(values) // 10], values[-1 - len(values) // 10]
        med = statistics.median(values)
        print(f"| {name} | {med:.0f} | {lo:.0f}-{hi:.0f} | x{med / base:.2f} |")


if __name__ == "__main__":
    main()
