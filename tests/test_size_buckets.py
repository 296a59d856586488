"""Size buckets with padding (`compile(..., size_buckets=True)`, runners/size_buckets.py):
a dynamic capture recorded per size runs each size through the recording of its
power-of-two bucket where padding cannot reach the kept positions.  Run on the CPU
through the stand-in recording of test_graph_replay (the same `GraphReplay` a CUDA
entry runs).  Eager is the oracle: a graph the analysis accepts must give eager's
answers at every size, and one it refuses names the operation that stopped it."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from nnscaler_eval.runners import size_buckets
from test_graph_replay import cpu_replay_backend


class Causal(nn.Module):
    """A GPT block: token and learned position embeddings, causal attention."""

    def __init__(self, positions: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(100, 16)
        self.pos = nn.Embedding(positions, 16)
        self.ln = nn.LayerNorm(16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, ids):
        b, t = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        q, k, v = self.qkv(self.ln(x)).split(16, dim=2)
        q, k, v = (z.view(b, t, 2, 8).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).contiguous().view(b, t, 16))
        return x + self.mlp(self.ln(x))


class PerPosition(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = self.norm(self.fc(x)).relu()
        return h.cumsum(1), h[:, 0], torch.zeros_like(h) + h.amax(-1, keepdim=True)


class Batchwise(nn.Module):
    """A convolution whose batch is the only padded dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x).softmax(-1)


class Gathers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(50, 8))

    def forward(self, idx, w):
        return self.table.index_select(0, idx.flatten()).view(*idx.shape, 8) * w.unsqueeze(-1)


class ClassToken(nn.Module):
    """A token prepended (the length becomes L + 1), read back, and cut off again."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(torch.cat([self.cls.expand(x.shape[0], 1, 8), x], 1)).cumsum(1)
        return h[:, 0], h[:, 1:] * 2, torch.diff(x, dim=1, prepend=x[:, :1])


def _ids(b=2):
    return lambda n: (torch.randint(0, 100, (b, n)),)


# (label, model, arguments of size n, the (argument, dimension[, largest bucket]) that vary)
SOUND = [
    ("causal attention, batch and length", Causal,
     lambda n: (torch.randint(0, 100, (2 + n % 2, n)),), [(0, 0), (0, 1)]),
    ("per position, cumulative, first token", PerPosition, lambda n: (torch.randn(2, n, 8),),
     [(0, 1)]),
    # (the capture of a CPU convolution guards batch < 16: buckets stop at 15)
    ("convolution over a padded batch", Batchwise, lambda n: (torch.randn(min(n, 15), 3, 10),),
     [(0, 0, 15)]),
    ("a class token, a shift", ClassToken, lambda n: (torch.randn(2, n, 8),), [(0, 1)]),
    ("lookups by the caller's indices", Gathers,
     lambda n: (torch.randint(0, 50, (2, n)), torch.randn(2, n)), [(0, 1), (1, 1)]),
]


def _bucket(n):
    return 1 << (n - 1).bit_length()


def _twins(model_cls, **options):
    """(eager, compiled with size buckets, the sizes each recording was made for)."""
    torch.manual_seed(0)
    eager = model_cls().eval()
    recorded: list = []

    def backend(gm, examples):
        replay = cpu_replay_backend(gm, examples)
        recorded.append(tuple(tuple(e.shape) if isinstance(e, torch.Tensor) else e
                              for e in examples))
        return replay

    model = nnscaler.compile(copy.deepcopy(eager), backend=backend, dynamic=True,
                             size_buckets=True, **options)
    return eager, model, recorded


def _run(model_cls, make, sizes, **options):
    eager, model, recorded = _twins(model_cls, **options)
    with torch.no_grad():
        for n in sizes:
            args = make(n)
            torch.testing.assert_close(model(*args), eager(*args), rtol=1e-5, atol=1e-5)
    return model, recorded


def _note(model_cls, make, n=5):
    model = nnscaler.compile(model_cls().eval(), backend=cpu_replay_backend, dynamic=True,
                             size_buckets=True)
    with torch.no_grad():
        report = nnscaler.explain(model, *make(n))
    return report.entries[0].size_buckets, str(report)


@pytest.mark.parametrize("label, model_cls, make, varying", SOUND, ids=[s[0] for s in SOUND])
def test_a_padded_graph_gives_eager_answers_with_one_recording_per_bucket(label, model_cls, make,
                                                                          varying):
    sizes = [5, 7, 3, 6, 9, 12, 16, 2, 13, 8, 4]
    note, text = _note(model_cls, make)
    assert note.startswith("pads "), note
    assert f"size buckets: {note}" in text
    model, recorded = _run(model_cls, make, sizes)
    buckets = {tuple(min([_bucket(make(n)[v[0]].shape[v[1]]), *v[2:]]) for v in varying)
               for n in sizes}
    assert sorted(tuple(shapes[v[0]][v[1]] for v in varying) for shapes in recorded) \
        == sorted(buckets)   # one recording per bucket, each a power of two
    info = nnscaler.cache_info(model)
    assert info.captures == 1, info


class NotCausal(Causal):
    def forward(self, ids):
        x = self.tok(ids)
        q = x.view(*ids.shape, 2, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).sum(1)


class MeanOverLength(PerPosition):
    def forward(self, x):
        return self.fc(x).mean(1)


class LastToken(PerPosition):
    def forward(self, x):
        return self.fc(x)[:, -1]


class LastTokens(PerPosition):
    def forward(self, x):
        return self.fc(x)[:, -2:]


class ScaledByLength(PerPosition):
    def forward(self, x):
        return self.fc(x) / x.shape[1]


class SoftmaxOverLength(PerPosition):
    def forward(self, x):
        return self.fc(x).softmax(1)


class ConvolvesLength(Batchwise):
    def forward(self, x):
        return self.conv(x)


class WritesInput(PerPosition):
    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


class Flips(PerPosition):
    def forward(self, x):
        return self.fc(x).flip(1)


class Noise(PerPosition):
    def forward(self, x):
        return self.fc(x) + torch.randn(x.shape[0], x.shape[1], 8)


class ComputedPositions(Causal):
    def forward(self, ids):
        return self.pos(ids % 64) + self.tok(ids)


class JoinsLengths(PerPosition):
    def forward(self, x):
        return torch.cat([x, self.fc(x)], 1)


class MaskedScores(PerPosition):
    """Causal by a mask the graph builds: the softmax runs over padded keys."""

    def forward(self, x):
        t = x.shape[1]
        scores = x @ x.transpose(1, 2)
        mask = torch.full((t, t), float("-inf")).triu(1)
        return (scores + mask).softmax(-1) @ x


class ReturnsLength(PerPosition):
    def forward(self, x):
        return self.fc(x), x.shape[1] * 2


class Reinterprets(PerPosition):
    """A view that reads the (length, batch) order as (batch, length)."""

    def forward(self, x):
        b, t, d = x.shape
        return self.fc(x.transpose(0, 1).reshape(-1, d).view(b, t, d))


REFUSED = [
    (NotCausal, _ids(), "attends over a padded key dimension"),
    (MeanOverLength, lambda n: (torch.randn(2, n, 8),), "reduces over a padded dimension"),
    (LastToken, lambda n: (torch.randn(2, n, 8),), "counted from the end"),
    (LastTokens, lambda n: (torch.randn(2, n, 8),), "counts from the end"),
    (ScaledByLength, lambda n: (torch.randn(2, n, 8),), "uses a padded size as a value"),
    (SoftmaxOverLength, lambda n: (torch.randn(2, n, 8),), "reduces over a padded dimension"),
    (ConvolvesLength, lambda n: (torch.randn(2, 3, n),), "only its batch dimension"),
    (WritesInput, lambda n: (torch.randn(2, n, 8),), "writes its input 0 in place"),
    (Flips, lambda n: (torch.randn(2, n, 8),), "aten.flip has no padding rule"),
    (Noise, lambda n: (torch.randn(2, n, 8),), "draws random numbers"),
    (ComputedPositions, _ids(), "indices the graph computed"),
    (JoinsLengths, lambda n: (torch.randn(2, n, 8),), "joins along a padded dimension"),
    (MaskedScores, lambda n: (torch.randn(2, n, 8),), "reduces over a padded dimension"),
    (ReturnsLength, lambda n: (torch.randn(2, n, 8),), "a number computed from a padded size"),
    (Reinterprets, lambda n: (torch.randn(3, n, 8),), "cannot be told apart"),
]


@pytest.mark.parametrize("model_cls, make, reason", REFUSED, ids=[r[0].__name__ for r in REFUSED])
def test_padding_that_would_change_an_answer_is_refused_and_says_why(model_cls, make, reason):
    note, _ = _note(model_cls, make)
    # dynamic=True: the batch is symbolic too, and may be padded alone
    length = "ids.size(1)" if model_cls in (NotCausal, ComputedPositions) else \
        "x.size(2)" if model_cls is ConvolvesLength else "x.size(1)"
    assert f"{length}: " in note and reason in note.split(f"{length}: ", 1)[1], note
    # refused, the entry records each size: eager's answers, as without the option
    if model_cls is not WritesInput and model_cls is not Noise:
        _, recorded = _run(model_cls, make, [5, 7, 6])
        lengths = {shape[-1 if model_cls is ConvolvesLength else 1]
                   for shapes in recorded for shape in shapes[:1]}
        assert lengths == {5, 7, 6}, recorded


def test_a_bucket_outside_the_captures_shape_guards_records_the_exact_size():
    class Branches(PerPosition):
        def forward(self, x):
            h = self.fc(x)
            if x.shape[1] > 6:   # a guard on the length: 5 -> 8 would cross it
                return h * 2
            return h

    model, recorded = _run(Branches, lambda n: (torch.randn(2, n, 8),), [5, 3, 4, 6, 5])
    lengths = sorted({shapes[0][1] for shapes in recorded})
    # the entry's guard x.size(1) <= 6 caps the bucket: 5 -> 6, never 8
    assert lengths == [4, 6], recorded


def test_positions_read_by_arange_cap_the_bucket_at_the_table_size():
    model, recorded = _run(lambda: Causal(positions=40), _ids(1), [33, 35, 40, 20])
    lengths = sorted({shapes[0][1] for shapes in recorded})
    assert lengths == [32, 40], recorded   # 33..40 -> 40 (64 would index past 40)
    note, _ = _note(lambda: Causal(positions=40), _ids(1))
    assert "at most 40" in note


def test_positions_past_an_offset_cap_the_bucket_lower():
    class Shifted(Causal):
        def forward(self, ids):   # positions 2 .. t + 1 of a 40-row table
            return self.pos(torch.arange(ids.shape[1]) + 2) + self.tok(ids)

    model, recorded = _run(lambda: Shifted(positions=40), _ids(1), [30, 33, 36, 20])
    assert sorted({shapes[0][1] for shapes in recorded}) == [32, 38], recorded
    note, _ = _note(lambda: Shifted(positions=40), _ids(1))
    assert "at most 38" in note, note


def test_recordings_stay_within_cache_size_limit_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, recorded = _run(PerPosition, lambda n: (torch.randn(2, n, 8),),
                               [3, 5, 9, 17, 33, 3, 5, 40, 70], cache_size_limit=3)
    assert len(recorded) == 3, recorded
    assert sum("cache_size_limit" in str(w.message) for w in caught) == 1


def test_a_static_address_input_is_never_padded():
    eager, model, recorded = _twins(PerPosition)
    with torch.no_grad():
        for n in (5, 6):
            x = torch.randn(2, n, 8)
            torch._dynamo.mark_static_address(x)   # used in place: never copied into
            torch.testing.assert_close(model(x), eager(x))
    assert sorted(shapes[0] for shapes in recorded) == [(2, 5, 8), (2, 6, 8)], recorded


def test_the_option_is_checked_and_off_by_default():
    with pytest.raises(TypeError, match="size_buckets must be a bool"):
        nnscaler.compile(PerPosition(), size_buckets="yes")
    model = nnscaler.compile(PerPosition().eval(), backend=cpu_replay_backend, dynamic=True)
    with torch.no_grad():
        report = nnscaler.explain(model, torch.randn(2, 5, 8))
    assert report.entries[0].size_buckets == ""


def test_padded_calls_hand_out_fresh_outputs_and_leave_arguments_alone():
    eager, model, _ = _twins(PerPosition)
    with torch.no_grad():
        x5, x6 = torch.randn(2, 5, 8), torch.randn(2, 6, 8)
        before = x5.clone()
        first = model(x5)
        second = model(x6)   # the same bucket (8): its buffers are written again
        torch.testing.assert_close(first, eager(x5))
        torch.testing.assert_close(second, eager(x6))
        assert torch.equal(x5, before)
        assert all(t.is_contiguous() for t in first)


def test_the_plan_reads_aten_operations_not_a_list_of_modules():
    """The analysis runs on the ATen operations of the graph: a layer written with
    torch functions only is judged by what it does."""
    class Handmade(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            h = torch.einsum("btd,de->bte", x, self.w)
            return (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True) + 1e-5)

    note, _ = _note(Handmade, lambda n: (torch.randn(2, n, 8),))
    assert note.startswith("pads "), note
    _run(Handmade, lambda n: (torch.randn(2, n, 8),), [3, 5, 7])
    with pytest.raises(size_buckets.Refused, match="no symbolic sizes"):
        size_buckets.plan(torch.fx.symbolic_trace(Handmade()), [torch.randn(2, 3, 8)])


def _tiny_hf(kind):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)).eval()
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=48)).eval()
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64)).eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_hugging_face_decoder_pads_batch_and_length_under_its_causal_mask(kind):
    """transformers' decoders without a cache: the causal mask they build from
    positions (compared aranges, ANDed with the packed-sequence mask, turned into 0 /
    -inf) hides every padded key from each kept query, so batch and length pad; the
    learned positions of GPT-2 cap the length bucket at n_positions."""
    hf = _tiny_hf(kind)

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hf = copy.deepcopy(hf)

        def forward(self, ids):
            return self.hf(input_ids=ids, use_cache=False).logits

    make = lambda n: (torch.randint(0, 64, (2 + n % 2, n)),)   # noqa: E731
    note, _ = _note(Logits, make)
    assert note.startswith("pads ids.size(0)") and "ids.size(1) (" in note, note
    model, recorded = _run(Logits, make, [5, 7, 3, 12, 33, 40, 9])
    caps = 48 if kind == "gpt2" else 128
    assert sorted({shapes[0] for shapes in recorded}) == sorted(
        {(_bucket(2 + n % 2), min(_bucket(n), caps)) for n in [5, 7, 3, 12, 33, 40, 9]})
    if kind == "gpt2":
        assert "at most 48" in note


def test_an_encoder_attending_over_every_position_is_not_padded():
    bert = _tiny_hf("bert")

    class Hidden(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = copy.deepcopy(bert)

        def forward(self, ids):
            return self.bert(input_ids=ids).last_hidden_state

    note, _ = _note(Hidden, lambda n: (torch.randint(0, 64, (2, n)),))
    assert note.startswith("no size buckets") and "ids.size(1): " in note, note
    _run(Hidden, lambda n: (torch.randint(0, 64, (2, n)),), [5, 6])


def _positions(t):
    return torch.arange(t)[:, None], torch.arange(t)[None, :]   # query, key


MASKS = {
    # (mask of a length t, sound?)
    "keys up to the query": (lambda t: _positions(t)[1] <= _positions(t)[0], True),
    "the query after the key, written >": (lambda t: _positions(t)[0] > _positions(t)[1] - 1,
                                           True),
    "a causal window": (lambda t: (_positions(t)[1] <= _positions(t)[0])
                        & (_positions(t)[1] > _positions(t)[0] - 3), True),
    "0 / -inf": (lambda t: torch.where(_positions(t)[1] <= _positions(t)[0],
                                       torch.tensor(0.0), torch.tensor(float("-inf"))), True),
    "keys from the query on": (lambda t: _positions(t)[1] >= _positions(t)[0], False),
    "one key ahead": (lambda t: _positions(t)[1] <= _positions(t)[0] + 1, False),
    "0 / -5": (lambda t: torch.where(_positions(t)[1] <= _positions(t)[0],
                                     torch.tensor(0.0), torch.tensor(-5.0)), False),
    "causal or the first key": (lambda t: (_positions(t)[1] <= _positions(t)[0])
                                | (_positions(t)[1] == 0), False),
}


@pytest.mark.parametrize("label", list(MASKS))
def test_a_mask_built_from_positions_pads_only_when_it_hides_later_keys(label):
    mask_of, sound = MASKS[label]

    class Masked(PerPosition):
        def forward(self, x):   # heads of 4 (a fused kernel; CPU's math path for 3-D
            h = self.fc(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)   # refuses)
            return F.scaled_dot_product_attention(h, h, h, attn_mask=mask_of(x.shape[1]))

    make = lambda n: (torch.randn(2, n, 8),)   # noqa: E731
    note, _ = _note(Masked, make)
    assert ("x.size(1) (" in note.split(";")[0]) == sound, note
    _, recorded = _run(Masked, make, [5, 7, 6, 3])
    assert sorted({s[0][1] for s in recorded}) == ([4, 8] if sound else [3, 5, 6, 7])
