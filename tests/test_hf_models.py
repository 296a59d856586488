"""Real Hugging Face models (tiny configs, random weights) against eager.

Every returned tensor, KV-cache tensors included, must equal eager's across calls with
alternating input shapes, in eval and in train (dropout with the same seed), and
`generate()` with a KV cache must give eager's tokens and logits.
"""
import copy
import warnings

import pytest
import torch

import nnscaler
from oracle import assert_same

transformers = pytest.importorskip("transformers", reason="make test installs transformers")
transformers.logging.set_verbosity_error()

_KW = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=64)


def _config(name):
    t = transformers
    if name == "gpt2":
        return t.AutoModelForCausalLM, t.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                    n_positions=64)
    if name == "llama":
        return t.AutoModelForCausalLM, t.LlamaConfig(num_key_value_heads=2,
                                                     max_position_embeddings=64, **_KW)
    if name == "mixtral":
        return t.AutoModelForCausalLM, t.MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=64, **_KW)
    if name == "t5":
        return t.AutoModelForSeq2SeqLM, t.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            decoder_start_token_id=0)
    if name == "bart":
        return t.AutoModelForSeq2SeqLM, t.BartConfig(
            vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64)
    if name == "whisper":
        return t.AutoModelForSpeechSeq2Seq, t.WhisperConfig(
            vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
            max_target_positions=32, decoder_start_token_id=0, pad_token_id=0)
    if name == "bert":
        return t.AutoModel, t.BertConfig(max_position_embeddings=64, **_KW)
    if name == "vit":
        kw = {k: v for k, v in _KW.items() if k != "vocab_size"}
        return t.AutoModel, t.ViTConfig(image_size=16, patch_size=8, num_channels=3, **kw)
    raise AssertionError(name)


def _inputs(name, batch, length):
    if name == "vit":
        return dict(pixel_values=torch.randn(batch, 3, 16, 16))
    if name == "whisper":
        return dict(input_features=torch.randn(batch, 8, 32),
                    decoder_input_ids=torch.randint(1, 64, (batch, length)))
    if name in ("t5", "bart"):
        return dict(input_ids=torch.randint(1, 64, (batch, length)),
                    decoder_input_ids=torch.randint(1, 64, (batch, length)))
    return dict(input_ids=torch.randint(1, 64, (batch, length)))


def _pair(name):
    auto, config = _config(name)
    torch.manual_seed(0)
    reference = auto.from_config(config)
    compiled = nnscaler.compile(copy.deepcopy(reference))
    return compiled, reference


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral", "t5", "bart", "whisper", "bert",
                                  "vit"])
def test_outputs_and_caches_equal_eager(name):
    compiled, reference = _pair(name)
    for mode in ("eval", "train"):
        compiled.train(mode == "train")
        reference.train(mode == "train")
        for step, (batch, length) in enumerate([(1, 5), (2, 3), (1, 5)]):
            torch.manual_seed(step)
            inputs = _inputs(name, batch, length)
            torch.manual_seed(100 + step)
            got = compiled(**inputs)
            torch.manual_seed(100 + step)
            want = reference(**inputs)
            try:   # every field, every cache layer's attributes
                assert_same(got, want, atol=1e-5, rtol=1e-5)
            except AssertionError as exc:
                raise AssertionError(f"{name} {mode} call {step}: {exc}") from None
    # graphs ran: the third call of each mode repeats the first's shapes (models that
    # return a KV cache run their root eagerly; their layers are captured)
    infos = [nnscaler.cache_info(m) for m in compiled.modules()]
    assert sum(i.captures for i in infos) >= 2 and sum(i.hits for i in infos) >= 2, infos


def _cache_objects(cache):
    """The cache and every object inside it that is rebuilt: (class, object) pairs."""
    found = [cache]
    for name in ("self_attention_cache", "cross_attention_cache"):
        if getattr(cache, name, None) is not None:
            found += _cache_objects(getattr(cache, name))
    found += list(getattr(cache, "layers", None) or ())
    return found


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral", "t5", "bart", "whisper"])
def test_a_returned_kv_cache_is_rebuilt_and_the_root_captured_whole(name):
    """Called with the library's defaults (use_cache=True), the forward creates and
    returns a cache: the root is one graph, and every hit builds a fresh cache of the
    same classes around the graph's tensors."""
    compiled, reference = _pair(name)
    compiled.eval()
    reference.eval()
    torch.manual_seed(0)
    inputs = _inputs(name, 2, 4)
    with torch.no_grad():
        report = nnscaler.explain(compiled, **inputs)
        assert report.fallbacks == [] and len(report.graphs) == 1, report.fallbacks
        first, second = compiled(**inputs), compiled(**inputs)
        want = reference(**inputs)
    got_objects = _cache_objects(first.past_key_values)
    assert [type(o) for o in got_objects] == [type(o) for o in _cache_objects(want.past_key_values)]
    again = _cache_objects(second.past_key_values)
    assert all(a is not b for a, b in zip(got_objects, again))   # fresh objects per call
    assert_same(first, want, atol=1e-5, rtol=1e-5)
    # one call's cache is its own: growing it leaves the next call's alone
    for obj in got_objects[1:]:
        if hasattr(obj, "keys") and isinstance(obj.keys, torch.Tensor):
            obj.keys = obj.keys * 0
    with torch.no_grad():
        third = compiled(**inputs)
    assert_same(third, want, atol=1e-5, rtol=1e-5)
    assert nnscaler.cache_info(compiled).hits >= 2


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_returned_caches_over_lengths_equal_eager_attribute_by_attribute(sliding_window):
    """Lengths vary (a symbolic capture): the rebuilt cache's sizes and counters
    (a sliding-window layer's cumulative_length) are the call's, not the capture's."""
    t = transformers
    torch.manual_seed(0)
    reference = t.AutoModelForCausalLM.from_config(t.MistralConfig(
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=sliding_window,
        **_KW)).eval()
    compiled = nnscaler.compile(copy.deepcopy(reference))
    with torch.no_grad():
        for length in [5, 9, 3, 12, 1, 2, 7, 16]:
            ids = torch.randint(1, 64, (2, length))
            got, want = compiled(input_ids=ids), reference(input_ids=ids)
            try:   # exactly: the logits, every cache layer's attributes
                assert_same(got, want)
            except AssertionError as exc:
                raise AssertionError(f"length {length}: {exc}") from None
    assert nnscaler.cache_info(compiled).captures <= 5


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_with_kv_cache_equals_eager(name):
    compiled, reference = _pair(name)
    compiled.eval()
    reference.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch, length in [(1, 3), (2, 6)]:
            torch.manual_seed(batch)
            ids = torch.randint(1, 64, (batch, length))
            kwargs = dict(max_new_tokens=5, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))
            got = compiled.generate(ids, **kwargs)
            want = reference.generate(ids, **kwargs)
            assert torch.equal(got.sequences, want.sequences)
            assert_same(got, want, atol=1e-5, rtol=1e-5)   # logits per step, the cache


def test_decorated_forward_is_reported():
    compiled, _ = _pair("bert")
    compiled(**_inputs("bert", 1, 4))
    info = nnscaler.cache_info(compiled)
    assert info.captures >= 1 and info.entries >= 1
    report = nnscaler.explain(compiled, **_inputs("bert", 1, 4))
    assert report.graphs
