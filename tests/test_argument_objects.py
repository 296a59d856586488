"""Arguments that hold tensors in objects, and tensors that are arguments and state.

- A transformers `ModelOutput` or a dataclass passed in is keyed by its contents: its
  tensors are graph inputs, a new object with the same contents hits, and an
  encoder-decoder's `generate()` (which passes the encoder's output to every decoder
  step in a `BaseModelOutput`) is captured, not run eagerly.
- A tensor passed as an argument that is also state the forward reads (a global, a
  tensor attribute, a buffer) is an input like any other: a later call with another
  tensor gets eager's answer from the same entry.
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

import nnscaler
from oracle import agree, assert_same, twins


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    scale: float
    mask: torch.Tensor | None = None


class TakesBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, batch: Batch):
        out = self.proj(batch.tokens) * batch.scale
        return out if batch.mask is None else out * batch.mask


def test_a_new_dataclass_with_equal_contents_hits():
    compiled, eager = twins(TakesBatch())
    agree(compiled, eager, Batch(torch.randn(2, 4), 2.0), expect="capture")
    agree(compiled, eager, Batch(torch.randn(2, 4), 2.0), expect="hit")
    # what the key holds by value: another scale, a mask where there was none
    agree(compiled, eager, Batch(torch.randn(2, 4), 3.0), expect="capture")
    agree(compiled, eager, Batch(torch.randn(2, 4), 2.0, torch.ones(2, 4)), expect="capture")
    agree(compiled, eager, Batch(torch.randn(2, 4), 2.0, torch.ones(2, 4)), expect="hit")


def test_a_model_output_argument_is_an_input():
    outputs = pytest.importorskip("transformers.modeling_outputs")

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, encoded):
            return self.proj(encoded[0]) + encoded.last_hidden_state.sum()

    compiled, eager = twins(Head())
    for i in range(3):
        encoded = outputs.BaseModelOutput(last_hidden_state=torch.randn(2, 4))
        agree(compiled, eager, encoded, expect="capture" if i == 0 else "hit")


def test_a_forward_that_writes_into_a_model_output_argument_runs_eagerly():
    outputs = pytest.importorskip("transformers.modeling_outputs")

    class Writes(nn.Module):
        def forward(self, encoded):
            encoded.last_hidden_state = encoded.last_hidden_state * 2
            return encoded.last_hidden_state + 1

    compiled, eager = twins(Writes())
    for _ in range(3):
        t = torch.randn(3)
        a, b = outputs.BaseModelOutput(last_hidden_state=t), outputs.BaseModelOutput(last_hidden_state=t)
        assert_same(compiled(a), eager(b))
        assert_same(a.last_hidden_state, b.last_hidden_state)
        assert_same(a["last_hidden_state"], b["last_hidden_state"])


def _seq2seq(kind: str):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "t5":
        config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                       num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                       eos_token_id=1)
        return transformers.T5ForConditionalGeneration(config).eval()
    config = transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=128, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return transformers.BartForConditionalGeneration(config).eval()


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_generate_is_captured(kind):
    """Greedy generate() over 7 source lengths: eager's tokens, and two captures (the
    first decoder step with an empty cache, then one symbolic capture from the second
    step, with one token cached, for every later step)."""
    compiled, eager = twins(_seq2seq(kind))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for length in (5, 7, 9, 12, 6, 15, 2):
            ids = torch.randint(3, 64, (1, length))
            options = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
            assert torch.equal(compiled.generate(ids, **options), eager.generate(ids, **options))
    info = nnscaler.cache_info(compiled)
    assert info.captures <= 2 and info.fallbacks == 0, info
    assert info.hits >= 25, info


class BroadcastsTheCache(nn.Module):
    """Adds a parameter of length 5 to the cached keys: valid when the cache holds 1
    entry (broadcast) or 5, an error otherwise."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, 2, 5, 4))

    def forward(self, x, past_key_values):
        keys = past_key_values.layers[0].keys
        return (keys + self.bias).sum(-2) + x


def test_a_cache_of_one_is_symbolic_until_torch_decides_on_it():
    """A KV cache's length of 1 is a symbol (so a decoder's second step is not a capture
    of its own), yet a broadcast on it specialises the capture to 1: lengths 5 and 3
    are not served by it (5 captures again, 3 raises as eagerly)."""
    transformers = pytest.importorskip("transformers")

    def cache(length):
        config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=8,
                                          num_attention_heads=2, num_key_value_heads=2)
        made = transformers.DynamicCache(config=config)
        generator = torch.Generator().manual_seed(length)
        made.update(torch.randn(1, 2, length, 4, generator=generator),
                    torch.randn(1, 2, length, 4, generator=generator), 0)
        return made

    compiled, eager = twins(BroadcastsTheCache())
    x = torch.randn(1, 2, 4)
    for length in (1, 5, 1, 5, 3):
        if length == 3:
            with pytest.raises(RuntimeError):
                eager(x, cache(length))
            with pytest.raises(RuntimeError):
                compiled(x, cache(length))
            continue
        assert_same(compiled(x, cache(length)), eager(x, cache(length)), atol=1e-6)
    info = nnscaler.cache_info(compiled)
    assert info.captures == 2 and info.hits == 2, info


# -- tensors that are arguments and state ------------------------------------------

GLOBAL = torch.randn(3)


class ReadsGlobal(nn.Module):
    def forward(self, x):
        return x * 2 + GLOBAL


class ReadsAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.offset = torch.randn(3)          # a plain tensor attribute, not a buffer
        self.register_buffer("scale", torch.randn(3))

    def forward(self, x):
        return x * self.scale + self.offset


def test_a_global_tensor_passed_as_an_argument():
    compiled, eager = twins(ReadsGlobal())
    agree(compiled, eager, GLOBAL, expect="capture")
    agree(compiled, eager, torch.randn(3), expect="hit")
    agree(compiled, eager, GLOBAL, expect="hit")


@pytest.mark.parametrize("which", ["offset", "scale"])
def test_module_state_passed_as_an_argument(which):
    compiled, eager = twins(ReadsAttribute())
    for i, mine in enumerate([True, False, True]):
        x_c = getattr(compiled, which) if mine else torch.randn(3)
        x_e = getattr(eager, which) if mine else x_c
        assert_same(compiled(x_c), eager(x_e))
    info = nnscaler.cache_info(compiled)
    assert info.captures == 1 and info.fallbacks == 0, info
