"""Forward hooks run as graph nodes (capture/hook_nodes.py).

A hook that hands a tensor out of its module's call by another way than the result
(transformers' `output_hidden_states` / `output_attentions` collectors) used to make
the whole forward run eagerly.  After one eager call its module is traced inline and
each forward hook is a node run for real on every call.  Eager is the oracle: outputs,
what the hooks saw, their side effects and what they return.
"""
from __future__ import annotations

import contextvars
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import nnscaler
from oracle import agree, assert_same, served

COLLECTOR: contextvars.ContextVar = contextvars.ContextVar("collector", default=None)


def collector(key, index=None):
    """transformers' output-capturing hook: one code, a closure per kind of output."""

    def collect(module, args, output):
        found = COLLECTOR.get()
        if found is not None:
            found[key].append(output if index is None else output[index])

    return collect


class Scorer(nn.Module):
    """Returns its output and weights made inside: only a hook hands those out."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(8, 8)

    def forward(self, x):
        weights = torch.softmax(self.query(x) @ x.transpose(-1, -2), dim=-1)
        return weights @ x, weights


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scorer = Scorer()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        mixed, _ = self.scorer(x)
        return torch.relu(self.lin(mixed)) + x


class Collecting(nn.Module):
    """transformers' pattern: hooks installed lazily on the first call, a context
    variable as collector, what the hooks collected returned beside the output."""

    def __init__(self, hook=collector, with_kwargs=False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 4)
        self.hook = hook
        self.with_kwargs = with_kwargs

    def forward(self, x):
        if not getattr(self, "_hooks_installed", False):
            for block in self.blocks:
                block.register_forward_hook(self.hook("hidden"), with_kwargs=self.with_kwargs)
                block.scorer.register_forward_hook(self.hook("weights", 1),
                                                   with_kwargs=self.with_kwargs)
            self._hooks_installed = True
        token = COLLECTOR.set({"hidden": [], "weights": []})
        try:
            for block in self.blocks:
                x = block(x)
            collected = COLLECTOR.get()
        finally:
            COLLECTOR.reset(token)
        return self.head(x), tuple(collected["hidden"]), tuple(collected["weights"])


def pick(output, index):
    return output if index is None else output[index]


def make(**options):
    torch.manual_seed(0)
    model = Collecting(**options)
    return nnscaler.compile(copy.deepcopy(model)), model


def inputs(batch, seed):
    return torch.randn(batch, 5, 8, generator=torch.Generator().manual_seed(seed))


def test_collected_outputs_equal_eager_and_the_forward_is_one_graph():
    compiled, eager = make()
    # The lazy set-up runs once, uncached; the hooks it installed are followed from
    # the next call, which captures.
    agree(compiled, eager, inputs(2, 0), expect="eager")
    agree(compiled, eager, inputs(2, 1), expect="capture")
    for seed in range(2, 8):
        agree(compiled, eager, inputs(2, seed), expect="hit")
    report = nnscaler.explain(compiled, inputs(2, 9))
    assert len(report.graphs) == 1 and not report.fallbacks, report
    assert "run_forward_hook" in str(report)


@pytest.mark.parametrize("batch", [0, 1, 2, 17])
def test_sizes(batch):
    compiled, eager = make()
    for seed in range(5):
        agree(compiled, eager, inputs(batch, seed))
    agree(compiled, eager, inputs(batch, 5), expect="hit")


SEEN: dict = {}


def counting(key, index=None):
    """A hook with side effects (kept apart from the module's state, which is guarded
    by value: a counter the module reaches would recapture on every call)."""
    collect = collector(key, index)

    def hook(module, args, output):
        SEEN["calls"] += 1
        SEEN["sums"].append(float(pick(output, index).detach().sum()))
        collect(module, args, output)

    return hook


def test_hooks_run_on_every_call_with_that_calls_values():
    SEEN.update(calls=0, sums=[])
    seen = SEEN
    compiled, eager = make(hook=counting)
    for seed in range(6):
        x = inputs(2, seed)
        before = len(seen["sums"])
        got = compiled(x)
        compiled_sums = seen["sums"][before:]
        want = eager(x)
        eager_sums = seen["sums"][before + len(compiled_sums):]
        assert_same(got, want)
        assert compiled_sums == eager_sums
    assert served(compiled)[1] >= 3
    assert seen["calls"] == 2 * 6 * 3 * 2


def test_a_hook_that_replaces_the_output():
    def doubling(key, index=None):
        collect = collector(key, index)

        def hook(module, args, output):
            collect(module, args, output)
            return pytree.tree_map_only(torch.Tensor, lambda t: t * 2, output)

        return hook

    compiled, eager = make(hook=doubling)
    for seed in range(6):
        agree(compiled, eager, inputs(2, seed))
    agree(compiled, eager, inputs(2, 7), expect="hit")


def test_a_hook_with_kwargs():
    def with_kwargs(key, index=None):
        collect = collector(key, index)

        def hook(module, args, kwargs, output):
            collect(module, args, output)
            return pytree.tree_map_only(torch.Tensor, lambda t: t - args[0].mean(), output)

        return hook

    compiled, eager = make(hook=with_kwargs, with_kwargs=True)
    for seed in range(6):
        agree(compiled, eager, inputs(2, seed))
    agree(compiled, eager, inputs(2, 7), expect="hit")


def test_hooks_removed_or_added_after_the_capture():
    compiled, eager = make()
    for seed in range(4):
        agree(compiled, eager, inputs(2, seed))
    for model in (compiled, eager):
        model.blocks[1].scorer._forward_hooks.clear()
    for seed in range(4, 8):
        agree(compiled, eager, inputs(2, seed))

    def tripling(module, args, output):
        return output[0] * 3, output[1]

    for model in (compiled, eager):
        model.blocks[0].scorer.register_forward_hook(tripling)
    for seed in range(8, 12):
        agree(compiled, eager, inputs(2, seed))


def test_a_pre_hook_keeps_the_module_opaque():
    compiled, eager = make()
    for model in (compiled, eager):
        model(inputs(2, 0))  # hooks installed
        model.blocks[2].register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    for seed in range(1, 6):
        agree(compiled, eager, inputs(2, seed))


def test_train_mode_gradients_equal_eager():
    compiled, eager = make()
    compiled.train(), eager.train()
    for seed in range(5):
        x = inputs(2, seed)
        for model in (compiled, eager):
            model.zero_grad()
            out, hidden, weights = model(x)
            (out.sum() + sum(h.sum() for h in hidden) + sum(w.sum() for w in weights)).backward()
        # The capturing call's autograd graph also holds the aliases that stand for a
        # hook node's result: its gradients sum in another order (float rounding).
        capturing = seed == 1
        for a, b in zip(compiled.parameters(), eager.parameters()):
            assert_same(a.grad, b.grad, rtol=1e-4 if capturing else 1e-6, atol=1e-6)


def test_reset_forgets_the_followed_hooks():
    compiled, eager = make()
    for seed in range(4):
        agree(compiled, eager, inputs(2, seed))
    nnscaler.reset()
    for seed in range(4, 9):
        agree(compiled, eager, inputs(2, seed))


transformers = pytest.importorskip("transformers", reason="make test installs transformers")


@pytest.mark.parametrize("use_cache", [False, True])
def test_hf_hidden_states_and_attentions_equal_eager_in_one_graph(use_cache):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
        attn_implementation="eager")
    eager = transformers.LlamaForCausalLM(config).eval()
    compiled = nnscaler.compile(copy.deepcopy(eager))
    options = dict(output_hidden_states=True, output_attentions=True, use_cache=use_cache)
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for call in range(7):
            ids = torch.randint(0, 64, (1, 8), generator=generator)
            got = compiled(ids, **options)
            want = eager(ids, **options)
            assert len(want.hidden_states) == 3 and len(want.attentions) == 2
            assert_same(got.logits, want.logits)
            assert_same(got.hidden_states, want.hidden_states)
            assert_same(got.attentions, want.attentions)
        # the first call installs the hooks (uncached), the second captures
        assert served(compiled) == (1, 5, 1), nnscaler.cache_info(compiled)
        # the hooks stay on the modules; without the flags they collect nothing
        ids = torch.randint(0, 64, (1, 8), generator=generator)
        got, want = compiled(ids, use_cache=use_cache), eager(ids, use_cache=use_cache)
        assert got.attentions is None and want.attentions is None
        assert_same(got.logits, want.logits)
