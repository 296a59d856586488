"""KV caches passed in: decode steps and generate() captured whole, against eager.

A decoder's forward that takes a cache reads its tensors as graph inputs and writes
what `Cache.update` computed back into the caller's cache object
(capture/passed_objects.py); the call key describes the cache by its contents, so a new
cache per generate() hits the same entries (guarding/keyed_objects.py).  Eager is the
oracle: logits, the returned cache and every attribute of every cache layer.  Tensors
are compared with a tolerance of 1e-5: during a capture `torch.compiler.is_compiling()`
is true, and transformers then builds some attention masks its compile-safe way (a
sliding window's: equal to eager's to 3e-8, not bit for bit); tokens are compared
exactly.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import nnscaler
from oracle import assert_same

transformers = pytest.importorskip("transformers", reason="make test installs transformers")
transformers.logging.set_verbosity_error()
from transformers.cache_utils import DynamicCache  # noqa: E402

_KW = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=64)


def _model(name):
    t = transformers
    if name == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                              n_positions=128))
    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(num_key_value_heads=2,
                                                max_position_embeddings=128, **_KW))
    if name == "mistral":   # sliding-window layers: a cumulative_length int per layer
        return t.MistralForCausalLM(t.MistralConfig(num_key_value_heads=2, sliding_window=6,
                                                    max_position_embeddings=128, **_KW))
    if name == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(num_key_value_heads=2,
                                                max_position_embeddings=128, **_KW))
    if name == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=128, **_KW))
    if name == "t5":
        return t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            decoder_start_token_id=0))
    if name == "bart":
        return t.BartForConditionalGeneration(t.BartConfig(
            vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=128))
    if name == "whisper":
        return t.WhisperForConditionalGeneration(t.WhisperConfig(
            vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
            max_target_positions=64, decoder_start_token_id=0, pad_token_id=0))
    raise AssertionError(name)


def _pair(name):
    torch.manual_seed(0)
    reference = _model(name).eval()
    return nnscaler.compile(copy.deepcopy(reference)), reference


def _prefill(name, length):
    torch.manual_seed(length)
    if name == "whisper":
        return dict(input_features=torch.randn(1, 8, 32),
                    decoder_input_ids=torch.randint(1, 64, (1, length)))
    if name in ("t5", "bart"):
        return dict(input_ids=torch.randint(1, 64, (1, 6)),
                    decoder_input_ids=torch.randint(1, 64, (1, length)))
    return dict(input_ids=torch.randint(1, 64, (1, length)))


def _close(got, want, where):
    """Eager is the oracle (tests/oracle.py): the same structure and every leaf within
    1e-5; a cache by every attribute of every layer, a model output by every field."""
    try:
        assert_same(got, want, atol=1e-5, rtol=1e-5)
    except AssertionError as exc:
        raise AssertionError(f"{where}: {exc}") from None


def _step_inputs(name, token, cache, prefill, output):
    step = dict(past_key_values=cache)
    if name in ("t5", "bart", "whisper"):
        step["encoder_outputs"] = (output.encoder_last_hidden_state,)
        step["decoder_input_ids"] = token
    else:
        step["input_ids"] = token
    return step


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "mixtral", "t5",
                                  "bart", "whisper"])
def test_decode_steps_take_the_cache_and_equal_eager(name):
    """Prefill, then decode steps passing the cache back: every step's logits and the
    caller's cache, attribute by attribute, equal eager's; the caller's own cache
    object is updated and returned; one capture serves every decode step."""
    compiled, reference = _pair(name)
    with torch.no_grad():
        for length in (5, 3):
            prefill = _prefill(name, length)
            got, want = compiled(**prefill), reference(**prefill)
            _close(got, want, length)
            got_cache, want_cache = got.past_key_values, want.past_key_values
            for step in range(8):
                torch.manual_seed(1000 + step)
                token = torch.randint(1, 64, (1, 1))
                got = compiled(**_step_inputs(name, token, got_cache, prefill, got))
                want = reference(**_step_inputs(name, token, want_cache, prefill, want))
                _close(got, want, (length, step))   # logits and the cache
                assert got.past_key_values is got_cache   # the caller's object, updated
    info = nnscaler.cache_info(compiled)
    # the prefill at length 5, at length 3, and the decode step (sizes symbolic from
    # its first capture); nothing ran eagerly at the root.  A sliding window (mistral,
    # 6 tokens) decides in Python whether the window is full, and once it is, the layer
    # keeps a strided view of the last 5 tokens (a tensor that is not dense stays
    # static): a decode capture per case.
    assert info.fallbacks == 0 and info.captures <= (6 if name == "mistral" else 3), info


def _generate_equal(compiled, reference, lengths, kwargs):
    """generate() on prompts of these lengths: tokens equal, scores close."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for length in lengths:
            torch.manual_seed(length)
            ids = torch.randint(1, 64, (1, length))
            got, want = compiled.generate(ids, **kwargs), reference.generate(ids, **kwargs)
            assert torch.equal(got.sequences, want.sequences), length
            _close(got, want, length)   # scores, one per step, and the cache


@pytest.mark.parametrize("name,beams", [("gpt2", 1), ("llama", 1), ("llama", 3)])
def test_generate_takes_two_captures_and_equals_eager(name, beams):
    """generate() across prompt lengths: one capture for the prefill and one for the
    decode step serve every length of 2 and more, tokens and scores equal to eager's
    (greedy, and beam search, which reorders the cache between steps)."""
    compiled, reference = _pair(name)
    kwargs = dict(max_new_tokens=10, do_sample=False, num_beams=beams, pad_token_id=0,
                  output_scores=True, return_dict_in_generate=True)
    _generate_equal(compiled, reference, (4, 19, 2, 40) if beams == 1 else (4, 13, 2), kwargs)
    info = nnscaler.cache_info(compiled)
    assert info.captures == 2 and info.fallbacks == 0, info


def test_generate_with_a_static_cache_equals_eager():
    """A StaticCache: fixed buffers updated in place (index_copy_ on graph inputs) and a
    tensor position; tokens and scores equal eager's."""
    compiled, reference = _pair("llama")
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True, cache_implementation="static")
    _generate_equal(compiled, reference, (12, 5, 9), kwargs)
    info = nnscaler.cache_info(compiled)
    # Prompts no longer than the first keep transformers' static cache length (it
    # grows the model's `_previous_max_cache_length` only for a longer one).
    assert info.captures == 2 and info.fallbacks == 0, info


class _Attention(nn.Module):
    """A decoder layer's attention in transformers' style: `cache.update` inside."""

    def __init__(self, index):
        super().__init__()
        self.index = index
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, cache):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        k, v = cache.update(k, v, self.index)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Attention(i) for i in range(2))

    def forward(self, x, **kwargs):
        cache = kwargs["state"]["cache"]
        for layer in self.layers:
            x = x + layer(x, cache).squeeze(1)
        return x, cache


def test_a_cache_inside_kwargs_grown_from_empty_edited_between_calls():
    """A cache inside `**kwargs` (a dict), starting with no layers (update appends
    them: new objects the runner builds per call), edited by the caller between calls
    (crop, reorder, reset, a replaced tensor): eager's cache after every call."""
    torch.manual_seed(0)
    reference = _Decoder()
    compiled = nnscaler.compile(copy.deepcopy(reference))
    got_cache, want_cache = DynamicCache(), DynamicCache()
    edits = {3: lambda c: c.crop(-2), 5: lambda c: c.reorder_cache(torch.tensor([1, 0])),
             7: lambda c: c.reset(), 9: lambda c: setattr(c.layers[0], "keys",
                                                          c.layers[0].keys * 2)}
    with torch.no_grad():
        for step in range(12):
            torch.manual_seed(step)
            x = torch.randn(2, 3 if step in (0, 8) else 1, 8)
            got_x, got_c = compiled(x, state={"cache": got_cache})
            want_x, want_c = reference(x, state={"cache": want_cache})
            assert torch.equal(got_x, want_x), step
            assert got_c is got_cache
            _close(got_cache, want_cache, step)
            if step in edits:
                edits[step](got_cache)
                edits[step](want_cache)
    assert nnscaler.cache_info(compiled).fallbacks == 0


class _Stamping(nn.Module):
    def forward(self, x, cache):
        cache.note = object()          # not something a runner can rebuild
        return x + 1


def test_a_write_the_runner_cannot_replay_is_not_cached():
    compiled = nnscaler.compile(_Stamping())
    cache = DynamicCache()
    for _ in range(3):
        before = getattr(cache, "note", None)
        assert torch.equal(compiled(torch.ones(2), cache), torch.ones(2) + 1)
        assert cache.note is not before   # eager's write, every call
    assert nnscaler.cache_info(compiled).hits == 0


class _TwoCaches(nn.Module):
    """Two cache arguments, each updated: passed one cache twice, eager updates it
    twice (the second update sees the first's)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x, first, second):
        k, v = self.proj(x).unsqueeze(1).chunk(2, dim=-1)
        a, _ = first.update(k, v, 0)
        b, _ = second.update(k * 2, v * 2, 0)
        return a.sum(-2) + b.sum(-2)


def test_one_cache_passed_twice_is_not_two_caches():
    torch.manual_seed(0)
    reference = _TwoCaches()
    compiled = nnscaler.compile(copy.deepcopy(reference))

    def caches(shared):
        first = DynamicCache()
        return (first, first) if shared else (first, DynamicCache())

    with torch.no_grad():
        for shared in (False, True, False, True):
            got_c, want_c = caches(shared), caches(shared)
            for step in range(3):
                x = torch.randn(1, 2, 4)
                got, want = compiled(x, *got_c), reference(x, *want_c)
                _close(got, want, (shared, step))
                _close(got_c, want_c, (shared, step))
