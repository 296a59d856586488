"""CUDA paths (skipped without a GPU): eager / inductor / cudagraphs on CUDA tensors,
and the device guard between CPU and CUDA entries."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import nnscaler
from models import MLP, Block

pytestmark = pytest.mark.gpu
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_cuda_tensors_through_backends(backend):
    eager = Block().cuda().eval()
    model = nnscaler.compile(copy.deepcopy(eager), backend=backend)
    x = torch.randn(2, 8, 32, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(eager(x), model(x), **TOL)
    assert nnscaler.cache_info(model).hits >= 2


def test_cudagraphs_replays_with_new_inputs():
    eager = MLP().cuda().eval()
    model = nnscaler.compile(copy.deepcopy(eager), backend="cudagraphs")
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(4, 16, device="cuda")
            out = model(x)
            torch.testing.assert_close(eager(x), out, **TOL)
    assert nnscaler.cache_info(model).hits >= 3
    # the entry's runner is the replay itself: a hit runs no Python frame of ours
    from nnscaler_eval import _C

    state = _C.code_state(type(model).forward.__code__) or {}
    runners = [e.runner for b in state.get("buckets", []) if b.self is model for e in b.entries]
    assert runners and all(isinstance(r, _C.GraphReplay) for r in runners)


def test_cpu_entry_is_not_used_for_cuda_inputs():
    model = nnscaler.compile(MLP())
    model(torch.randn(2, 16))
    model.cuda()
    out = model(torch.randn(2, 16, device="cuda"))
    assert out.is_cuda
    assert nnscaler.cache_info(model).captures == 2


# ---- real workloads on CUDA: generate() with KV caches, Inductor training, sizes ----

def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)).cuda().eval()


def _generate_equal(compiled, reference, lengths, **kwargs):
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True, **kwargs)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for length in lengths:
            torch.manual_seed(length)
            ids = torch.randint(1, 64, (1, length), device="cuda")
            got, want = compiled.generate(ids, **kwargs), reference.generate(ids, **kwargs)
            assert torch.equal(got.sequences, want.sequences), length
            for a, b in zip(got.scores, want.scores, strict=True):
                torch.testing.assert_close(a, b, **TOL)
    # every graph was compiled by the backend named (no fallback to the eager backend)
    failed = [str(w.message) for w in caught if "failed to compile" in str(w.message)]
    assert not failed, failed


@pytest.mark.parametrize("backend", ["eager", "cudagraphs"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_on_cuda_equals_eager(backend, cache):
    """generate() on CUDA: the dynamic cache (new tensors each step) and the static one
    (buffers written in place with index_copy_), through the eager backend and CUDA
    graphs (which copy inputs into static buffers: an in-place write to a cache buffer
    must still reach the caller's cache; a dynamic capture is recorded per concrete
    size, never from its symbolic example inputs).  Tokens equal eager's.  Capture
    counts are checked on CPU (tests/test_kv_cache_inputs.py): on the GPU machine's
    older transformers a print() in its attention makes some calls run eagerly."""
    reference = _tiny_llama()
    compiled = nnscaler.compile(copy.deepcopy(reference), backend=backend)
    extra = {} if cache == "dynamic" else {"cache_implementation": "static"}
    _generate_equal(compiled, reference, (5, 9, 3), **extra)
    assert nnscaler.cache_info(compiled).hits > 0


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_training_steps_on_cuda_equal_eager(backend):
    """Forward, backward and SGD steps on CUDA, train() then eval() then train():
    parameters equal eager's.  Dropout off for Inductor, whose random numbers are its
    own (as under torch.compile); the flag-dependent paths still switch."""
    torch.manual_seed(0)
    eager = Block(p=0.2 if backend == "eager" else 0.0).cuda()
    model = nnscaler.compile(copy.deepcopy(eager), backend=backend)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_m = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        mode = "eval" if step == 3 else "train"
        getattr(eager, mode)()
        getattr(model, mode)()
        x = torch.randn(2, 8, 32, device="cuda")
        for net, opt in ((eager, opt_e), (model, opt_m)):
            opt.zero_grad()
            torch.manual_seed(step)
            net(x).square().mean().backward()
            opt.step()
        for (n, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"{n} step {step}")
    assert nnscaler.cache_info(model).hits >= 3


def test_sequence_lengths_that_vary_on_cuda():
    """Lengths 0..large on CUDA through one symbolic capture (after the first), eager's
    answers."""
    eager = Block().cuda().eval()
    model = nnscaler.compile(copy.deepcopy(eager))
    with torch.no_grad():
        for length in (8, 9, 1, 2, 64, 3, 17, 0, 300):
            x = torch.randn(2, length, 32, device="cuda")
            torch.testing.assert_close(eager(x), model(x), **TOL)
    info = nnscaler.cache_info(model)
    assert info.fallbacks == 0 and info.captures <= 4, info


def test_size_buckets_record_powers_of_two_on_cuda():
    """`size_buckets=True` with CUDA graphs: a causal block over lengths 3..40 runs
    from one recording per power of two, each length padded, with eager's answers
    (tests/test_size_buckets.py checks the analysis and refusals on the CPU)."""
    from test_size_buckets import Causal

    torch.manual_seed(0)
    eager = Causal().cuda().eval()
    model = nnscaler.compile(copy.deepcopy(eager), backend="cudagraphs", dynamic=True,
                             size_buckets=True, cache_size_limit=16)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for length in (5, 7, 3, 6, 9, 12, 16, 13, 33, 40, 8):
            ids = torch.randint(0, 100, (2, length), device="cuda")
            torch.testing.assert_close(model(ids), eager(ids), **TOL)
    # no size fell back to the eager backend (a failed recording warns)
    assert not [w for w in caught if "nnscaler" in str(w.message)], caught
    report = nnscaler.explain(nnscaler.compile(copy.deepcopy(eager), backend="cudagraphs",
                                               dynamic=True, size_buckets=True),
                              torch.randint(0, 100, (2, 5), device="cuda"))
    assert report.entries[0].size_buckets.startswith("pads "), report.entries[0].size_buckets
