"""Sizes stay symbolic through the ops real models use: padding computed from a length,
resizing by a scale factor or to a size, a Hugging Face causal LM's loss (which pads
its labels).  Each case: eager's answers, and no more captures than torch.compile
takes frames for the same calls (2 here: the first size, then one symbolic)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from oracle import agree, twins


class PadToMultiple(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        length = x.shape[1]
        return self.proj(F.pad(x, (0, 0, 0, (-length) % 8)))


class ScaleBy2(nn.Module):
    def forward(self, x):
        return F.interpolate(x, scale_factor=2)


class ResizeTo(nn.Module):
    def forward(self, x):
        h, w = x.shape[-2:]
        return F.interpolate(x, size=(h * 2, w * 2), mode="bilinear")


CASES = {
    "pad_to_multiple": (PadToMultiple, [(2, n, 4) for n in (5, 9, 13, 3, 17, 30, 31, 7, 12)]),
    "interpolate_scale": (ScaleBy2, [(1, 3, n, n) for n in (4, 6, 8, 10, 12, 14)]),
    "interpolate_size": (ResizeTo, [(1, 3, n, n + 1) for n in (4, 6, 8, 10, 12, 14)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_padding_and_resizing_keep_sizes_symbolic(name, capfd):
    make, shapes = CASES[name]
    compiled, eager = twins(make())
    for shape in shapes:
        agree(compiled, eager, torch.randn(*shape), rtol=1e-5, atol=1e-6)
    info = nnscaler.cache_info(compiled)
    assert info.captures == 2 and info.fallbacks == 0, info
    assert capfd.readouterr().err == ""   # nothing logged where eager logs nothing


@torch.library.custom_op("nnscaler_test::no_fake_kernel", mutates_args=())
def _no_fake_kernel(x: torch.Tensor) -> torch.Tensor:
    return x * 2   # no register_fake: fake tensors cannot run it


def test_an_op_that_refuses_symbolic_sizes_is_named_in_the_log(caplog):
    """The symbolic capture fails; the log says which op and which argument, and the
    call is captured statically."""
    class Refuses(nn.Module):
        def forward(self, x):
            return _no_fake_kernel(x) + 1

    compiled, eager = twins(Refuses())
    import nnscaler_eval.logs
    caplog.set_level("INFO", logger="nnscaler.recaptures")
    nnscaler_eval.logs.configure()
    for n in (4, 5, 7):
        agree(compiled, eager, torch.randn(2, n, 3))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "sizes stay static" in text, text
    assert "no_fake_kernel refused symbolic sizes (argument 0: a tensor of shape (2, s" in text, text


def _causal_lm(kind: str):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
            use_cache=False)
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=128, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("labels", ["same_tensor", "own_tensor"])
def test_causal_lm_training_with_labels_over_varying_lengths(kind, labels):
    """transformers' loss pads the labels with F.pad; `labels=input_ids` passes one
    tensor twice.  Training steps over 8 lengths: at most 3 captures, eager's losses
    and gradients."""
    compiled, eager = twins(_causal_lm(kind).train())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for length in (8, 9, 12, 17, 5, 30, 3, 24):
            ids = torch.randint(0, 64, (2, length))
            target = ids if labels == "same_tensor" else ids.clone()
            torch.manual_seed(length)
            got = compiled(input_ids=ids, labels=target)
            torch.manual_seed(length)
            want = eager(input_ids=ids, labels=target)
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
            got.loss.backward()
            want.loss.backward()
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    info = nnscaler.cache_info(compiled)
    assert info.captures <= 3 and info.fallbacks == 0, info
