"""What the capture makes of real Hugging Face models that write module state, build
modules in forward or cache tensors (issue 18): per model, over four calls with one
input in eval (grad enabled, as a user's evaluation loop without no_grad), the root's
captures, hits and calls run eagerly, the same summed over every module, the first
fallback reason `explain()` gives, and whether every output equals eager's.

    .venv/bin/python -m benchmarks.hf_capture_report [--models swin,ctrl,...]

Tiny configs, random weights (nothing is downloaded).  Not a test: it reports.
"""
from __future__ import annotations

import argparse
import copy
import sys
import warnings
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

import nnscaler

_TEXT = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64)


def _models() -> dict[str, Callable[[], tuple[Any, dict]]]:
    import transformers as t

    ids = lambda: torch.randint(0, 64, (2, 8))  # noqa: E731

    def swin():
        cfg = t.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
                           num_heads=[2, 2], window_size=4)
        return t.SwinModel(cfg), dict(pixel_values=torch.randn(2, 3, 32, 32))

    def ctrl():
        cfg = t.CTRLConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, dff=64,
                           n_positions=64)
        return t.CTRLModel(cfg), dict(input_ids=ids(), use_cache=False)

    def funnel():
        cfg = t.FunnelConfig(vocab_size=64, d_model=32, n_head=4, d_head=8, d_inner=64,
                             block_sizes=[1, 1], num_decoder_layers=1)
        return t.FunnelModel(cfg), dict(input_ids=ids())

    def mamba():
        cfg = t.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                            state_size=8, expand=2, conv_kernel=4)
        return t.MambaModel(cfg), dict(input_ids=ids(), use_cache=False)

    def blip_text():
        cfg = t.BlipTextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64,
                               encoder_hidden_size=32, max_position_embeddings=64)
        return t.BlipTextModel(cfg, add_pooling_layer=False), dict(input_ids=ids())

    def recurrent_gemma():
        cfg = t.RecurrentGemmaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1,
                                     intermediate_size=64, lru_width=32,
                                     attention_window_size=8, head_dim=8,
                                     block_types=["recurrent", "attention"])
        return t.RecurrentGemmaModel(cfg), dict(input_ids=ids(), use_cache=False)

    def levit():
        cfg = t.LevitConfig(image_size=32, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2],
                            depths=[1, 1, 1], key_dim=[8, 8, 8], patch_size=16, stride=2,
                            down_ops=[["Subsample", 8, 1, 4, 2, 2], ["Subsample", 8, 2, 4, 2, 2]])
        return t.LevitModel(cfg), dict(pixel_values=torch.randn(2, 3, 32, 32))

    return {"swin": swin, "ctrl": ctrl, "funnel": funnel, "mamba": mamba,
            "blip_text": blip_text, "recurrent_gemma": recurrent_gemma, "levit": levit}


def _tensors(out: Any) -> list[torch.Tensor]:
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def report(name: str, make: Callable[[], tuple[Any, dict]]) -> str:
    torch.manual_seed(0)
    try:
        eager, inputs = make()
    except Exception as exc:  # a config this transformers does not have
        return f"{name}: not built ({type(exc).__name__}: {str(exc)[:120]})"
    eager.eval()
    ours = copy.deepcopy(eager)
    nnscaler.compile(ours)
    equal = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            want, got = _tensors(eager(**inputs)), _tensors(ours(**inputs))
            equal = equal and len(want) == len(got) and all(
                a.shape == b.shape and torch.equal(a, b) for a, b in zip(want, got))
    root = nnscaler.cache_info(ours)
    every = [nnscaler.cache_info(m) for m in ours.modules()]
    total = tuple(sum(getattr(i, f) for i in every) for f in ("captures", "hits", "fallbacks"))
    reason = ""
    if root.fallbacks:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            fresh, _ = make()
            explained = nnscaler.explain(fresh.eval(), **inputs)
        if explained.fallbacks:
            reason = f"; first fallback: {str(explained.fallbacks[0])[:160]}"
    return (f"{name}: root captures={root.captures} hits={root.hits} eager runs="
            f"{root.fallbacks}; all modules captures={total[0]} hits={total[1]} "
            f"eager runs={total[2]}; outputs equal eager: {equal}{reason}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma list (default: all)")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    models = _models()
    names = [n for n in args.models.split(",") if n] or list(models)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"Python {sys.version.split()[0]}")
    for name in names:
        nnscaler.reset()
        print(report(name, models[name]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
