"""CUDA dispatch where users run it: a decode step and generate() on one GPU, ours against
eager and torch.compile, interleaved, one report.

    python -m benchmarks.gpu [--out REPORT.md] [--quick]

Cases (each under torch.no_grad(), batch 1):
- `decode`: one decode step of a 12-block GPT (d=128, 4 heads) over a 64-token
  context: the forward a KV-cache loop calls per token;
- `generate`: `generate()` of a tiny llama with a static cache, 32 new tokens.

Variants: eager; ours (`nnscaler.compile`, eager backend); ours with
`backend="cudagraphs"`; `torch.compile(mode="reduce-overhead")` (CUDA graphs);
`torch.compile()` (Inductor).  Per call: CPU time of the calling thread
(`time.thread_time`: what dispatch costs the host) and wall time with the device
synchronised after each call, medians over interleaved repeats (the order rotated
per repeat), per token for `generate`; and the peak CUDA memory of each variant's
warm-up and runs (`torch.cuda.max_memory_allocated`, reset per variant).  Every
variant's outputs are compared with eager's first (tokens for generate).

Without a CUDA device it says so and exits 0: `make gpu-check` runs it everywhere.
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
import torch.nn as nn
import torch.nn.functional as F


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                ) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.view(b, t, self.heads, -1).transpose(1, 2)
        k = torch.cat([k_cache, k.view(b, t, self.heads, -1).transpose(1, 2)], dim=2)
        v = torch.cat([v_cache, v.view(b, t, self.heads, -1).transpose(1, 2)], dim=2)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class DecodeStep(nn.Module):
    """A GPT decode step: one new token attending to a fixed-length cache per block."""

    def __init__(self, blocks: int = 12, d: int = 128, heads: int = 4, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(blocks))
        self.head = nn.Linear(d, vocab)

    def forward(self, token: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
                ) -> torch.Tensor:
        x = self.embed(token)
        for i, block in enumerate(self.blocks):
            x = block(x, keys[i], values[i])
        return self.head(x)


def _decode_case(quick: bool) -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    torch.manual_seed(0)
    model = DecodeStep(blocks=4 if quick else 12).cuda().eval()
    heads, d = 4, 128
    token = torch.randint(0, 256, (1, 1), device="cuda")
    shape = (len(model.blocks), 1, heads, 64, d // heads)
    keys, values = torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda")
    return model, lambda m: m(token, keys, values)


def _generate_case(quick: bool) -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config).cuda().eval()
    ids = torch.randint(1, 64, (1, 8), device="cuda")
    tokens = 8 if quick else 32
    options = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                   pad_token_id=0, cache_implementation="static",
                   attention_mask=torch.ones_like(ids))
    return model, lambda m: m.generate(ids, **options)


def _variants(model: nn.Module) -> dict[str, nn.Module]:
    import nnscaler
    out: dict[str, nn.Module] = {"eager": model}
    out["ours"] = nnscaler.compile(copy.deepcopy(model))
    out["ours cudagraphs"] = nnscaler.compile(copy.deepcopy(model), backend="cudagraphs")
    for name, options in (("torch.compile reduce-overhead", {"mode": "reduce-overhead"}),
                          ("torch.compile", {})):
        compiled = copy.deepcopy(model)
        compiled.forward = torch.compile(compiled.forward, **options)
        out[name] = compiled
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if a.dtype in (torch.int64, torch.int32):
            return torch.equal(a, b)
        return torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)
    return a == b


def _run_case(name: str, case: Callable[[bool], Any], quick: bool, repeats: int,
              per: int) -> list[str]:
    model, call = case(quick)
    models = _variants(model)
    lines = [f"## {name}", ""]
    peak: dict[str, float] = {}
    with torch.no_grad():
        reference = call(models["eager"])
        for label, m in models.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            try:
                for _ in range(3):          # captures, compiles, recordings
                    out = call(m)
                torch.cuda.synchronize()
                agrees = _same(out, reference)
            except Exception as exc:        # a variant that cannot run: said, not hidden
                lines.append(f"- {label}: failed ({type(exc).__name__}: {exc})")
                models[label] = None  # type: ignore[assignment]
                continue
            peak[label] = torch.cuda.max_memory_allocated() / 2 ** 20
            if not agrees:
                lines.append(f"- {label}: DIFFERS from eager")
        live = {k: v for k, v in models.items() if v is not None}
        cpu: dict[str, list[float]] = {k: [] for k in live}
        wall: dict[str, list[float]] = {k: [] for k in live}
        order = list(live)
        for r in range(repeats):
            for label in order[r % len(order):] + order[:r % len(order)]:
                torch.cuda.synchronize()
                c0, w0 = time.thread_time(), time.perf_counter()
                call(live[label])
                c1 = time.thread_time()
                torch.cuda.synchronize()
                w1 = time.perf_counter()
                cpu[label].append((c1 - c0) / per * 1e6)
                wall[label].append((w1 - w0) / per * 1e6)
    base_cpu, base_wall = statistics.median(cpu["eager"]), statistics.median(wall["eager"])
    unit = "per token" if per > 1 else "per call"
    lines += [f"| variant | CPU us {unit} | / eager | wall us {unit} | / eager | peak MiB |",
              "|---|---|---|---|---|---|"]
    for label in live:
        c, w = statistics.median(cpu[label]), statistics.median(wall[label])
        lines.append(f"| {label} | {c:.1f} | x{c / base_cpu:.2f} | {w:.1f} | "
                     f"x{w / base_wall:.2f} | {peak.get(label, float('nan')):.1f} |")
    if "ours" in live:
        import nnscaler
        for label in ("ours", "ours cudagraphs"):
            if label in live:
                lines.append(f"\n{label}: {nnscaler.cache_info(live[label])}")
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="write the report here too")
    parser.add_argument("--quick", action="store_true", help="4 blocks, 8 tokens, 5 repeats")
    options = parser.parse_args()
    header = [f"# GPU dispatch ({time.strftime('%Y-%m-%d')})", "",
              f"Python {platform.python_version()}, torch {torch.__version__}"]
    if not torch.cuda.is_available():
        report = header + ["", "SKIPPED: no CUDA device here; nothing was measured."]
        _emit(report, options.out)
        return 0
    header[-1] += (f", {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}; "
                   f"CPU {platform.processor() or platform.machine()}")
    warnings.filterwarnings("ignore")
    repeats = 5 if options.quick else 15
    report = header + [""]
    report += _run_case("12-block GPT decode step, batch 1, 64-token cache", _decode_case,
                        options.quick, repeats, per=1)
    tokens = 8 if options.quick else 32
    report += _run_case(f"tiny llama generate(), static cache, {tokens} new tokens",
                        _generate_case, options.quick, max(3, repeats // 3), per=tokens)
    _emit(report, options.out)
    return 0


def _emit(lines: list[str], out: str | None) -> None:
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if out:
        with open(out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
