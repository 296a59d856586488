"""Dynamic shapes and int arguments (capture/dynamic.py): one capture serves every
size its guards allow, and eager is the oracle for every construct."""

from __future__ import annotations

import math
import os
import random
import struct
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import nnscaler
import nnscaler_eval
from nnscaler_eval import _C
from nnscaler_eval.capture import dynamic
from oracle import agree, twins


LENGTHS = [8, 9, 0, 1, 2, 37, 5, 64, 3, 16, 2, 300, 1, 8, 12]


def _entries(module):
    return [e for e in _bucket_entries(module)]


def _bucket_entries(module):
    import gc
    return [o for o in gc.get_objects() if type(o) is _C.CacheEntry and o.info is not None
            and o.info.where.startswith(type(module).__name__ + ".")]


class Attention(nn.Module):
    """view with sizes, masks from lengths, arange, slicing, a size-dependent branch."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.pos = nn.Parameter(torch.randn(512, 16))

    def forward(self, x):
        B, L, D = x.shape
        h = x + self.pos[:L]
        q, k, v = self.qkv(h).view(B, L, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        mask = torch.ones(L, L, dtype=torch.bool).triu(1)
        a = (q @ k.transpose(-1, -2) / math.sqrt(D // 4)).masked_fill(mask, -1e9)
        if L > 32:
            a = a * 0.5
        out = (a.softmax(-1) @ v).transpose(1, 2).reshape(B, L, D)
        return out + torch.arange(L, dtype=out.dtype)[:, None] / max(L, 1)


def test_sequence_lengths_in_any_order_agree_with_eager():
    compiled, eager = twins(Attention())
    for L in LENGTHS:
        agree(compiled, eager, torch.randn(2, L, 16))
    info = nnscaler.cache_info(compiled)
    # static 8, then symbolic (L <= 32 and L > 32), and the specialised 0 and 1
    assert info.captures <= 5, info
    assert info.hits >= len(LENGTHS) - 5


def test_dynamic_false_specialises_every_size():
    compiled, eager = twins(Attention(), dynamic=False, cache_size_limit=32)
    for L in [4, 5, 6, 7]:
        agree(compiled, eager, torch.randn(2, L, 16))
    assert nnscaler.cache_info(compiled).captures == 4


def test_dynamic_true_is_symbolic_from_the_first_capture():
    compiled, eager = twins(Attention(), dynamic=True)
    for L in [4, 5, 6, 7, 20]:
        agree(compiled, eager, torch.randn(3, L, 16))
    assert nnscaler.cache_info(compiled).captures == 1
    agree(compiled, eager, torch.randn(5, 9, 16))   # the batch is symbolic too
    assert nnscaler.cache_info(compiled).captures == 1


@pytest.mark.parametrize("marker", ["ours", "torch"])
def test_mark_dynamic_makes_the_first_capture_symbolic(marker):
    compiled, eager = twins(Attention())
    for L in [6, 7, 30]:
        x = torch.randn(2, L, 16)
        if marker == "ours":
            nnscaler.mark_dynamic(x, 1)
        else:
            torch._dynamo.mark_dynamic(x, 1)
        agree(compiled, eager, x)
    assert nnscaler.cache_info(compiled).captures == 1


def test_mark_static_keeps_a_dimension_specialised():
    compiled, eager = twins(Attention(), cache_size_limit=32)
    for L in [6, 7, 8]:
        x = torch.randn(2, L, 16)
        nnscaler.mark_static(x, 1)
        agree(compiled, eager, x)
    assert nnscaler.cache_info(compiled).captures == 3


def test_mark_dynamic_checks_its_arguments():
    with pytest.raises(IndexError, match="out of range"):
        nnscaler.mark_dynamic(torch.randn(2, 3), 5)
    with pytest.raises(TypeError, match="must be an int"):
        nnscaler.mark_dynamic(torch.randn(2, 3), "1")
    with pytest.raises(TypeError, match="expected a tensor"):
        nnscaler.mark_dynamic([1, 2], 0)


class PythonDecisions(nn.Module):
    """Python decisions on sizes: each is a guard or a specialisation."""

    def forward(self, x):
        L = x.shape[1]
        out = x
        for i in range(min(L, 3)):             # unrolled: specialises min(L, 3)
            out = out + i
        if L % 4 == 0:                          # divisibility
            out = out * 2
        table = {L: 1.0}                        # a size as a dict key
        out = out * table[x.size(1)]
        pad = [0] * (L % 3)                     # a list length
        out = out + len(pad)
        text = f"{L}"                           # formatting
        out = out + len(text)
        return out * math.sqrt(L) + int(L) // 2


def test_python_decisions_on_sizes_agree_with_eager():
    compiled, eager = twins(PythonDecisions(), cache_size_limit=64)
    rng = random.Random(1)
    lengths = [rng.choice([0, 1, 2, 3, 4, 7, 8, 12, 100, 101]) for _ in range(40)]
    for L in lengths:
        agree(compiled, eager, torch.randn(2, L))


class SqueezeThenUseTheSize(nn.Module):
    """squeeze() drops a dimension only when it is 1: torch's "size-oblivious" rule
    (the general case assumed, as torch.export's backed_size_oblivious) would bake the
    general shape into `y.shape[0]` and get size 1 wrong."""

    def forward(self, x, y):
        s = x.squeeze()
        return s.reshape(-1) * s.shape[0], x + y


def test_size_one_is_decided_not_assumed():
    compiled, eager = twins(SqueezeThenUseTheSize(), cache_size_limit=64)
    for n, m in [(3, 3), (4, 4), (1, 1), (1, 5), (5, 1), (2, 2), (1, 1), (6, 6)]:
        agree(compiled, eager, torch.randn(n, 2), torch.randn(m, 2))


class ReturnsSizes(nn.Module):
    def forward(self, x, n):
        L = x.shape[1]
        return x * 2, L * 2, torch.sym_float(L) / 2, n + 1, {"len": L}, [L, n], L > 4


class ReturnsAnObjectHoldingASize(nn.Module):
    class Box:
        def __init__(self, n):
            self.n = n

    def forward(self, x):
        return x + 1, self.Box(x.shape[0])


def test_sizes_and_scalars_returned_are_the_calls_values():
    compiled, eager = twins(ReturnsSizes(), dynamic=True)
    for L in (3, 5, 8, 2, 5):
        agree(compiled, eager, torch.randn(2, L), L + 4)
    assert nnscaler.cache_info(compiled).captures <= 2
    compiled, eager = twins(ReturnsAnObjectHoldingASize(), dynamic=True)
    for n in (3, 5, 8):
        assert compiled(torch.randn(n))[1].n == n


class TwoInputs(nn.Module):
    def forward(self, x, y):
        return (x + y).expand(3, *x.shape).repeat(1, 2, 1)


def test_equal_dimensions_are_guarded_not_assumed():
    compiled, eager = twins(TwoInputs())
    for n in [4, 5, 6, 9]:
        agree(compiled, eager, torch.randn(n, 3), torch.randn(n, 3))
    # broadcasting against 1, and a mismatch that eager rejects
    agree(compiled, eager, torch.randn(5, 3), torch.randn(1, 3))
    with pytest.raises(RuntimeError):
        compiled(torch.randn(5, 3), torch.randn(6, 3))
    agree(compiled, eager, torch.randn(7, 3), torch.randn(7, 3))


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x).flatten(2).mean(-1)


def test_strides_are_part_of_the_check():
    compiled, eager = twins(Conv())
    for size in [8, 9, 10]:
        agree(compiled, eager, torch.randn(2, 3, size, size))
    for size in [8, 11]:
        cl = torch.randn(2, 3, size, size).to(memory_format=torch.channels_last)
        agree(compiled, eager, cl)
        agree(compiled, eager, torch.randn(2, 3, size, 2 * size)[..., ::2])  # not dense
        agree(compiled, eager, torch.randn(2, size, size, 3).permute(0, 3, 1, 2))


class Timestep(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, t: int, scale: float = 1.0):
        freqs = torch.exp(-math.log(10000.0) * torch.arange(4) / 4)
        emb = t * freqs
        e = torch.cat([emb.sin(), emb.cos()])
        if t % 2 == 0:
            e = e * 2
        return self.proj(x + e) * scale


def test_int_arguments_become_symbolic():
    compiled, eager = twins(Timestep())
    steps = [999, 950, 900, 851, 800, 751, 700, 650, 600, 551, 500, 450, 0, 1]
    for t in steps:
        agree(compiled, eager, torch.randn(2, 8), t)
    assert nnscaler.cache_info(compiled).captures <= 5   # static, even, odd, 0, 1
    agree(compiled, eager, torch.randn(2, 8), 7, 0.5)


def test_bool_arguments_stay_specialised():
    class M(nn.Module):
        def forward(self, x, flag: bool):
            return x * 2 if flag else x - 1

    compiled, eager = twins(M())
    for flag in [True, False, True, False]:
        agree(compiled, eager, torch.randn(3), flag)


def test_data_dependent_forward_stays_static_and_correct():
    class M(nn.Module):
        def forward(self, x):
            if x.shape[0] > 4:
                return x * x.sum().item()
            return x + 1

    compiled, eager = twins(M(), cache_size_limit=32)
    for n in [2, 3, 5, 6, 7, 3]:
        agree(compiled, eager, torch.randn(n))


def test_modules_with_hooks_are_not_run_on_fakes():
    calls = []

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.inner.register_forward_hook(lambda m, i, o: calls.append(tuple(o.shape)))

        def forward(self, x):
            return self.inner(x).relu()

    compiled, eager = twins(M(), cache_size_limit=32)
    for n in [2, 3, 4, 5]:
        agree(compiled, eager, torch.randn(n, 4))
    # one call of the hook per call of each model, never with a fake tensor
    assert len(calls) == 8 and all(isinstance(s[0], int) for s in calls)


def test_counters_written_by_forward_count_as_in_eager():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls = self.calls + 1
            return x * x.shape[0]

    compiled, eager = twins(M(), cache_size_limit=32)
    for n in [2, 3, 4, 5, 6]:
        agree(compiled, eager, torch.randn(n))
    assert compiled.calls == eager.calls == 5


def test_batchnorm_statistics_update_once():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(x)

    compiled, eager = twins(M().train())
    for n in [3, 4, 5, 6, 9]:
        agree(compiled, eager, torch.randn(n, 4))
    assert torch.equal(compiled.bn.running_mean, eager.bn.running_mean)
    assert compiled.bn.num_batches_tracked == eager.bn.num_batches_tracked == 5


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.att = Attention()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50)

    def forward(self, ids):
        return self.head(self.norm(self.att(self.emb(ids))))


def test_training_with_variable_lengths_matches_eager():
    model = TinyLM()
    compiled, eager = twins(model)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    rng = random.Random(0)
    for _ in range(20):
        L = rng.randint(1, 40)
        ids = torch.randint(0, 50, (2, L))
        target = torch.randint(0, 50, (2, L))
        losses = []
        for m, opt in ((compiled, opt_c), (eager, opt_e)):
            loss = nn.functional.cross_entropy(m(ids).flatten(0, 1), target.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        assert torch.equal(*losses)
    for p, q in zip(compiled.parameters(), eager.parameters()):
        assert torch.equal(p, q)
    assert nnscaler.cache_info(compiled).captures <= 4


def test_explain_shows_symbols_and_their_guards():
    compiled, eager = twins(Attention(), dynamic=True)
    text = str(nnscaler.explain(compiled, torch.randn(2, 40, 16)))
    assert "symbolic" in text and "x.size(1)" in text and "x.size(1) > 32" in text


def test_torch_cond_with_a_size_predicate():
    class M(nn.Module):
        def forward(self, x):
            return torch.cond(x.shape[0] > 4, lambda t: t.cos(), lambda t: t.sin(), (x,))

    compiled, eager = twins(M(), cache_size_limit=32)
    for n in [2, 3, 5, 6, 4, 8]:
        agree(compiled, eager, torch.randn(n, 3))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_decoders_over_lengths(arch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100,
                                         n_positions=128)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32,
                                          intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=100,
                                          max_position_embeddings=128)
        model = transformers.LlamaForCausalLM(config)
    model.eval()
    compiled, eager = twins(model)
    lengths = list(range(1, 65))
    random.Random(0).shuffle(lengths)
    with torch.no_grad():
        for L in lengths:
            ids = torch.randint(0, 100, (2, L))
            got = compiled(input_ids=ids, use_cache=False).logits
            want = eager(input_ids=ids, use_cache=False).logits
            assert torch.equal(got, want), L
    # the first length static, then one symbolic capture, and length 1 on its own
    assert nnscaler.cache_info(compiled).captures <= 3


# ----------------------------------------------------------- the C guard program


def _key(*values):
    return _C.call_key_bytes(_C.CallKey(*values))


def test_layout_names_sizes_strides_and_ints():
    key = _C.CallKey(torch.randn(2, 3), 5, "a")
    layout = _C.call_key_layout(key)
    data = _C.call_key_bytes(key)
    kind, offset, ndim = layout[0]
    assert (kind, ndim) == ("tensor", 2)
    assert struct.unpack_from("4q", data, offset) == (2, 3, 3, 1)
    assert layout[1][0] == "int" and struct.unpack_from("q", data, layout[1][1]) == (5,)
    assert layout[2][0] == "other"
    with pytest.raises(TypeError):
        _C.call_key_layout(object())


def _program(*ops):
    return [getattr(_C, f"SG_{op}") if isinstance(op, str) else op for op in ops]


def test_guard_program_semantics_match_python():
    stored = _key(7)
    offset = _C.call_key_layout(_C.CallKey(7))[0][1]
    for a in [-7, -1, 0, 3, 7, 2 ** 62]:
        for b in [-3, -1, 1, 2, 5]:
            for op, fn in [("FLOORDIV", lambda x, y: x // y), ("MOD", lambda x, y: x % y)]:
                want = fn(a, b)
                code = _program("LOAD", offset, "CONST", b, op, "CONST", want, "EQ", "CHECK")
                assert _C.shape_guards_match(stored, _key(a), [offset], code), (a, op, b)
    # overflow and division by zero fail the match, never wrap
    code = _program("LOAD", offset, "LOAD", offset, "MUL", "CONST", 0, "NE", "CHECK")
    assert not _C.shape_guards_match(stored, _key(2 ** 40), [offset], code)
    code = _program("CONST", 1, "LOAD", offset, "FLOORDIV", "CHECK")
    assert not _C.shape_guards_match(stored, _key(0), [offset], code)
    # the fused checks: a field against a constant or another field
    two = _C.call_key_layout(_C.CallKey(7, 7))
    a, b = two[0][1], two[1][1]
    for x, y in [(3, 3), (3, 4), (9, 2)]:
        key = _key(x, y)
        for op, want in [("CHECK_GE_CONST", x >= 3), ("CHECK_LE_CONST", x <= 3),
                         ("CHECK_EQ_CONST", x == 3)]:
            assert _C.shape_guards_match(_key(7, 7), key, [a, b], _program(op, a, 3)) == want
        assert _C.shape_guards_match(_key(7, 7), key, [a, b],
                                     _program("CHECK_EQ_LOAD", a, b)) == (x == y)
    # bytes outside the symbolic fields must be equal
    assert not _C.shape_guards_match(_key(7, 1), _key(8, 2), [offset], [])
    assert _C.shape_guards_match(_key(7, 1), _key(8, 1), [offset], [])


@pytest.mark.parametrize("wild, code, message", [
    ([10 ** 6], [], "outside the key"),
    ([], [1], "lacks its operand"),
    ([], [_C.SG_ADD], "underflow"),
    ([], [_C.SG_CONST, 1], "unchecked"),
    ([], [99], "unknown opcode"),
    ([], [_C.SG_CHECK_EQ_CONST, 0], "lacks its operands"),
    ([], [_C.SG_CHECK_EQ_LOAD, 0, 10 ** 6], "outside the key"),
    ([], [_C.SG_LOAD, 10 ** 6, _C.SG_CHECK], "outside the key"),
    ([], [_C.SG_CONST, 1] * 65 + [_C.SG_CHECK] * 65, "deeper"),
])
def test_guard_programs_are_validated(wild, code, message):
    with pytest.raises(ValueError, match=message):
        _C.shape_guards_match(_key(1), _key(1), wild, code)


def test_an_entry_takes_shape_guards_once_and_before_it_is_stored():
    entry = _C.CacheEntry(None, [], [], (), None, ())
    entry.set_shape_guards([], [_C.SG_CONST, 1, _C.SG_CHECK], 20)
    assert entry.shape_guards == ((), (_C.SG_CONST, 1, _C.SG_CHECK))
    with pytest.raises(ValueError, match="already"):
        entry.set_shape_guards([], [], 20)


def test_plan_ignores_subclasses_parameters_and_nested_tensors():
    class Sub(torch.Tensor):
        pass

    values = (torch.randn(2, 3).as_subclass(Sub), nn.Parameter(torch.randn(2)),
              (torch.randn(2),), 3)
    table = dynamic.field_table(_C.CallKey(*values), values)
    assert set(dynamic._symbolic_candidates(table)) == {(3, None)}


class TensorTimestep(nn.Module):
    """diffusers' way: an int timestep made a tensor inside the forward."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, t):
        if not torch.is_tensor(t):
            t = torch.tensor([t], dtype=torch.long, device=x.device)
        t = t.expand(x.shape[0])
        emb = torch.exp(-torch.arange(2) * 0.5)[None] * t[:, None].float()
        return self.proj(x + torch.cat([emb.sin(), emb.cos()], -1))


def test_an_int_made_tensor_data_stays_symbolic():
    compiled, eager = twins(TensorTimestep())
    for t in range(999, 700, -23):   # 14 timesteps
        agree(compiled, eager, torch.randn(2, 4), t)
    assert nnscaler.cache_info(compiled).captures == 2


class FloatScale(nn.Module):
    def forward(self, x, sigma: float):
        return x * sigma + sigma * sigma / (sigma + 1.0)


class FloatDecision(nn.Module):
    def forward(self, x, sigma: float):
        if sigma > 0.5:
            return x * 2
        return x * math.log(sigma)


def test_float_arguments_used_in_arithmetic_become_inputs():
    compiled, eager = twins(FloatScale())
    for sigma in [0.9, 0.8, 0.7, 0.3, 2.5, -1.5, 1e-3]:
        agree(compiled, eager, torch.randn(3), sigma)
    assert nnscaler.cache_info(compiled).captures == 2


def test_float_arguments_python_decides_on_stay_specialised():
    compiled, eager = twins(FloatDecision(), cache_size_limit=32)
    for sigma in [0.9, 0.8, 0.3, 0.2, 0.9, 0.3]:
        agree(compiled, eager, torch.randn(3), sigma)
    assert nnscaler.cache_info(compiled).captures == 4


def test_the_log_says_which_size_was_specialised_and_where(caplog):
    import logging

    class M(nn.Module):
        def forward(self, x):
            n = int(x.shape[1])          # the value itself: specialised here
            return x * n

    compiled, eager = twins(M())
    with caplog.at_level(logging.INFO, logger="nnscaler.recaptures"):
        for L in [3, 4, 5, 6]:
            agree(compiled, eager, torch.randn(2, L))
    text = caplog.text
    assert "capturing with x.size(1) symbolic" in text
    assert "specialised: x.size(1) == 4" in text and "test_dynamic_shapes.py:" in text
    assert nnscaler.cache_info(compiled).captures == 4   # static from then on


def test_an_aot_backend_compiles_the_symbolic_graph_once():
    """torch.compile backends get the symbolic capture with fake inputs of its
    ShapeEnv (aot_eager here; Inductor the same way, slower to compile)."""
    compiled, eager = twins(Attention(), backend="aot_eager")
    for L in [6, 7, 9, 12, 20, 3]:
        x = torch.randn(2, L, 16)
        torch.testing.assert_close(compiled(x), eager(x))
    info = nnscaler.cache_info(compiled)
    assert info.captures == 2 and info.hits == 4, info


class ViewBySize(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, k):
        return self.fc(x).view(x.shape[0], 2, 2) * x.shape[0] + k


def _concrete_only(compiled_sizes, fail_on=()):
    def backend(gm, examples):
        sizes = tuple(tuple(e.shape) if isinstance(e, torch.Tensor) else e for e in examples)
        if any(isinstance(v, (torch.SymInt, torch.SymFloat))
               for v in torch.utils._pytree.tree_leaves(sizes)):
            raise ValueError("this backend needs concrete sizes")
        if sizes[0][0] in fail_on:
            raise RuntimeError(f"refuses {sizes[0]}")
        compiled_sizes.append(sizes)
        return gm.forward
    return backend


def test_a_backend_refusing_symbolic_inputs_compiles_per_size_without_recapture():
    compiled_sizes: list = []
    compiled, eager = twins(ViewBySize(), backend=_concrete_only(compiled_sizes, fail_on=(9,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n, k in [(3, 2), (5, 3), (7, 3), (5, 3), (7, 4), (9, 4), (9, 4), (2, 5)]:
            agree(compiled, eager, torch.randn(n, 4), k)
    assert nnscaler.cache_info(compiled).captures == 2     # one static, one symbolic
    shapes = [s[0] for s in compiled_sizes]
    assert shapes.count((5, 4)) == 1 and shapes.count((7, 4)) == 2   # per size and int
    messages = [str(w.message) for w in caught]
    assert sum("refuses (9, 4)" in m for m in messages) == 1, messages
    # a hit of a size met before runs no Python of ours (the runner looks it up)
    frames: list = []
    x = torch.randn(7, 4)
    sys.setprofile(lambda frame, event, arg: frames.append(frame.f_code.co_filename)
                   if event == "call" else None)
    try:
        compiled(x, 3)
    finally:
        sys.setprofile(None)
    package = os.path.dirname(os.path.abspath(nnscaler_eval.__file__))
    assert [f for f in frames if f.startswith(package)] == []
    text = str(nnscaler.explain(nnscaler.compile(ViewBySize(), dynamic=True,
                                                 backend=_concrete_only([])),
                                torch.randn(6, 4), 1))
    assert "compiles it once per size" in text and "needs concrete sizes" in text


def test_inductor_compiles_the_symbolic_graph_once():
    """One Inductor compile of the dynamic entry serves every later length, and the
    guards Inductor adds while compiling are checked on every hit."""
    compiled, eager = twins(Attention(), backend="inductor")
    with torch.no_grad():
        for L in [6, 7, 9, 12, 20, 3, 31]:
            x = torch.randn(2, L, 16)
            torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)
    info = nnscaler.cache_info(compiled)
    assert info.captures == 2 and info.hits == 5, info


def test_export_keeps_marked_dimensions_symbolic():
    model = Attention()
    gm = nnscaler.export(model, torch.randn(2, 8, 16), dynamic_dims={"x": 1})
    assert "x.size(1)" in gm.code and "view(2, size" in gm.code
    assert "x.size(1) <= 32" in gm.meta["shape_guards"]
    for L in [3, 8, 20]:
        x = torch.randn(2, L, 16)
        torch.testing.assert_close(gm(x), model(x))
    x = torch.randn(2, 8, 16)
    nnscaler.mark_dynamic(x, 0)
    assert "x.size(0)" in nnscaler.export(model, x).code


def test_export_says_which_marked_dimension_was_fixed():
    with pytest.raises(nnscaler.ExportError, match=r"x.size\(2\) == 16"):
        nnscaler.export(Attention(), torch.randn(2, 8, 16), dynamic_dims={"x": 2})
    with pytest.raises(ValueError, match="not an argument"):
        nnscaler.export(Attention(), torch.randn(2, 8, 16), dynamic_dims={"y": 0})
    with pytest.raises(nnscaler.ExportError, match="sizes 0 and 1"):
        nnscaler.export(Attention(), torch.randn(1, 8, 16), dynamic_dims={"x": 0})


class CachesByLength(nn.Module):
    """A per-length cache in module state: the symbolic capture meets a write it
    cannot replay, after the forward stored a fake in it."""

    def __init__(self):
        super().__init__()
        self.cache = {}
        self.seen = []

    def forward(self, x):
        L = x.shape[0]
        if L > 4:
            if L not in self.cache:
                self.cache[L] = torch.arange(L, dtype=x.dtype)
            self.seen.append(L)
            return x + self.cache[L]
        return x * 2


def test_a_failed_symbolic_capture_leaves_no_fake_in_module_state():
    compiled, eager = twins(CachesByLength(), cache_size_limit=32)
    for n in [2, 3, 6, 7, 6, 3]:
        agree(compiled, eager, torch.randn(n))
    assert compiled.seen == eager.seen
    assert compiled.cache.keys() == eager.cache.keys()
    for value in compiled.cache.values():
        assert type(value) is torch.Tensor   # a real tensor, not a fake


_MEANWHILE: list = []   # what "another thread" does while a capture runs


class HooksChangeMeanwhile(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.unused = nn.Identity()

    def forward(self, x):
        while _MEANWHILE:
            _MEANWHILE.pop(0)()
        return self.fc(x)


def test_a_failed_symbolic_capture_keeps_hooks_changed_meanwhile():
    """Another thread (stood in for by the forward) removes a hook and adds one while
    the symbolic capture runs; the capture then aborts at the newly hooked module, and
    putting module state back must leave the hook tables as they are now."""
    net = HooksChangeMeanwhile()
    ran = []
    old = net.unused.register_forward_hook(lambda *a: ran.append("old"))
    compiled = nnscaler.compile(net)
    compiled(torch.randn(2, 4))
    compiled(torch.randn(3, 4))
    added = []
    _MEANWHILE[:] = [old.remove,
                     lambda: added.append(net.fc.register_forward_hook(
                         lambda *a: ran.append("fc")))]
    try:
        compiled(torch.randn(5, 4))
    finally:
        _MEANWHILE.clear()
    assert len(net.unused._forward_hooks) == 0   # not brought back
    assert len(net.fc._forward_hooks) == 1       # not dropped
    ran.clear()
    compiled(torch.randn(6, 4))
    assert ran == ["fc"]
    added[0].remove()


# ------------------------------------------------ Python in the middle of the C paths


class _Meddling:
    """An int whose __index__ runs Python first (what the program reader calls)."""

    def __init__(self, value, meddle):
        self.value, self.meddle = value, meddle

    def __index__(self):
        self.meddle()
        return self.value


def test_program_reader_survives_a_list_emptied_by_index():
    layout = _C.call_key_layout(_C.CallKey(5, 5))
    a, b = layout[0][1], layout[1][1]
    wild: list = []
    wild += [_Meddling(a, wild.clear), b]       # the first item empties its own list
    code: list = []
    code += [_C.SG_CHECK_EQ_LOAD, _Meddling(a, code.clear), b]
    # each list is read from a snapshot: emptying it meanwhile changes nothing
    assert _C.shape_guards_match(_key(5, 5), _key(6, 6), wild, code)
    assert not _C.shape_guards_match(_key(5, 5), _key(6, 7), [a, b], [_C.SG_CHECK_EQ_LOAD, a, b])
    assert wild == [] and code == []


def test_set_shape_guards_reentered_from_index_overwrites_nothing():
    entry = _C.CacheEntry(None, [], [], (), None, ())
    inner = [_C.SG_CONST, 1, _C.SG_CHECK]
    reenter = _Meddling(1, lambda: entry.set_shape_guards([], inner, 16))
    with pytest.raises(ValueError, match="already"):
        entry.set_shape_guards([], [_C.SG_CONST, reenter, _C.SG_CHECK], 16)
    assert entry.shape_guards == ((), tuple(inner))   # the inner call's, not leaked over


RESET_DURING_A_DYNAMIC_HIT = r"""
# read by the guards after a key matched the dynamic entry's symbolic fields
Flaky.forward = lambda self, x: x * x.shape[0] if self.training else x + 1
m = nnscaler.compile(Flaky(), dynamic=True)
for n, meddle in ((3, False), (4, False), (5, True), (6, True), (7, False), (8, True)):
    m.meddle = meddle
    x = torch.arange(float(n))
    assert torch.equal(m(x), x * n), (n, m(x))
print("ok")
"""


def test_reset_while_a_dynamic_entry_checks_its_guards():
    from test_hardening import FLAKY, run_script

    assert run_script(FLAKY + RESET_DURING_A_DYNAMIC_HIT).stdout.strip().endswith("ok")


class _Noisy(torch.Tensor):
    """A subclass whose __torch_function__ drops the model's caches mid-call."""

    victim = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.victim is not None:
            nnscaler.reset()
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_subclass_resetting_caches_mid_capture_keeps_answers_right():
    compiled, eager = twins(Attention())
    for L in [6, 7, 9]:
        agree(compiled, eager, torch.randn(2, L, 16))
    _Noisy.victim = compiled
    try:
        for L in [10, 11]:
            x = torch.randn(2, L, 16)
            got = compiled(x.as_subclass(_Noisy)).as_subclass(torch.Tensor)
            torch.testing.assert_close(got, eager(x), rtol=0, atol=0)
    finally:
        _Noisy.victim = None
    agree(compiled, eager, torch.randn(2, 12, 16))
