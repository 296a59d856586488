"""Forwards that branch on tensor values, written the way models write them.

Shared by tests/test_control_flow.py (each is one graph, equal to eager on inputs that
take every side, no recapture when the test flips) and benchmarks/control_flow.py
(steady state against eager and torch.compile).  `SUITE` lists the convertible ones with
inputs that drive each of their sides; `REFUSED` those that must fall back, with words
of the reason.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN = 16


class Expert(nn.Module):
    """A feed-forward expert (user code: checked when a side calls it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoEMaskAny(nn.Module):
    """Top-1 mixture of experts that skips an expert no token was routed to
    (`if mask.any()`), one `if` per expert."""

    def __init__(self, dim: int = HIDDEN, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        weight, choice = probs.max(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            mask = choice == i
            if mask.any():
                out = out + expert(x) * (weight * mask).unsqueeze(-1)
        return out


class MoEGather(nn.Module):
    """Top-1 mixture of experts that runs each expert on its own tokens only:
    `idx = nonzero(...)`, and `if idx.numel() > 0` on that data-dependent count."""

    def __init__(self, dim: int = HIDDEN, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx = torch.nonzero(choice == i).squeeze(-1)
            if idx.numel() > 0:
                out = out.index_add(0, idx, expert(x[idx]))
        return out


class EarlyExit(nn.Module):
    """A classifier that answers after its first block when it is confident enough,
    and runs the deeper blocks otherwise (an early `return`)."""

    def __init__(self, dim: int = HIDDEN, classes: int = 5, threshold: float = 0.5) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.head_early = nn.Linear(dim, classes)
        self.deep = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, classes)
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        logits = self.head_early(h)
        if logits.softmax(-1).max(-1).values.min() > self.threshold:
            return logits
        h = self.deep(h) + h
        return self.head(h)


class AdaptiveComputation(nn.Module):
    """Adaptive computation time (Graves, 2016): up to `steps` refinement steps, each
    taken only while some element has not halted."""

    def __init__(self, dim: int = HIDDEN, steps: int = 4, eps: float = 0.01) -> None:
        super().__init__()
        self.cell = nn.Linear(dim, dim)
        self.halt = nn.Linear(dim, 1)
        self.steps = steps
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = x
        halted = torch.zeros(x.shape[0], 1)
        for _ in range(self.steps):
            if (halted < 1 - self.eps).any():
                p = torch.sigmoid(self.halt(state))
                running = (halted < 1 - self.eps).float()
                state = state + running * torch.tanh(self.cell(state))
                halted = halted + running * p
        return state


class NaNGuard(nn.Module):
    """Replaces non-finite values only when there are some."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.log(x) * 2
        if not torch.isfinite(y).all():
            y = torch.nan_to_num(y, nan=0.0, posinf=1e4, neginf=-1e4)
        return y + 1


class OverflowGuard(nn.Module):
    """Rescales activations whose magnitude passes a limit (an fp16-style guard)."""

    def __init__(self, dim: int = HIDDEN, limit: float = 100.0) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        peak = y.abs().max()
        if peak > self.limit:
            y = y * (self.limit / peak)
        return y


class PaddingMask(nn.Module):
    """Masks padded positions only when the batch has padding."""

    def __init__(self, dim: int = HIDDEN) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        valid = positions < lengths.unsqueeze(1)
        h = self.proj(x)
        if not valid.all():
            h = h.masked_fill(~valid.unsqueeze(-1), 0.0)
        return h.sum(1) / lengths.unsqueeze(1)


class NestedElif(nn.Module):
    """Routes by a statistic of the input: an `if` / `elif` / `else` chain, one side
    holding another `if`."""

    def __init__(self, dim: int = HIDDEN) -> None:
        super().__init__()
        self.small = nn.Linear(dim, dim)
        self.large = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        level = x.abs().mean()
        if level < 0.5:
            y = self.small(x)
        elif level < 2.0:
            y = self.small(x) + self.large(x)
            if y.mean() > 0:
                y = y * 0.5
        else:
            y = self.large(x / level)
        return y


class GatedBlock(nn.Module):
    """A residual block applied only when its gate opens; the block itself branches
    (an `if` in a submodule's forward, inside a side)."""

    class Inner(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.lin = nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            if h.norm() > 4.0:
                h = h / h.norm() * 4.0
            return h

    def __init__(self, dim: int = HIDDEN) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, 1)
        self.inner = GatedBlock.Inner(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate(x).mean() > 0:
            x = x + self.inner(x)
        return x


class SafeNormalize(nn.Module):
    """Standardises features unless they are (nearly) constant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        std = x.std()
        if std < 1e-3:
            out = x - mean
        else:
            out = (x - mean) / std
        return out


class LayerSkip(nn.Module):
    """A stack whose layers are applied while the update is still large: an `if` in a
    `for` loop over the layers, and a stack with no layers at all (zero iterations)."""

    def __init__(self, dim: int = HIDDEN, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.none = nn.ModuleList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.none:            # zero iterations
            if x.sum() > 0:
                x = layer(x)
        for layer in self.layers:
            update = torch.tanh(layer(x))
            if update.abs().mean() > 0.1:
                x = x + update
        return x


class ClampedTopK(nn.Module):
    """Keeps the scores above a floor, or the single best one when none is: a branch
    whose sides build different expressions of the same shape."""

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        keep = scores > 0.0
        if keep.any():
            out = scores * keep
        else:
            best = scores.max(-1, keepdim=True).values
            out = torch.where(scores == best, scores, torch.zeros_like(scores))
        return out.softmax(-1)


class ResidualScale(nn.Module):
    """Two plain arithmetic sides (no calls): the seed's ifexpr rule holds, so
    export_for_nnscaler writes it as ifexprs."""

    def __init__(self, dim: int = HIDDEN) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if h.mean() > 0:
            y = h * 0.5 + x
        else:
            y = x - h
        return y


class BeamSearchFixed(nn.Module):
    """Beam-search style decoding with fixed shapes: extend while any beam is
    unfinished, at most `steps` times (`while mask.any()`-style test, a tensor step
    counter); inputs where every beam is done at once run zero iterations."""

    def __init__(self, vocab: int = 8, steps: int = 5) -> None:
        super().__init__()
        self.step = nn.Linear(vocab, vocab)
        self.steps = steps

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        done = logits.argmax(-1) == 0
        n = torch.zeros((), dtype=torch.long)
        while (~done).any() & (n < self.steps):
            logits = self.step(logits.softmax(-1)) + logits
            done = done | (logits.argmax(-1) == 0)
            n = n + 1
        return logits * (n + 1)


class FixedPointSolve(nn.Module):
    """Solves h = tanh(W h + x) by iterating to a tolerance (a DEQ-style layer):
    `while delta > tol:`, then a projection."""

    def __init__(self, dim: int = HIDDEN, tol: float = 1e-4, limit: int = 50) -> None:
        super().__init__()
        self.w = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            self.w.weight.mul_(0.3)
        self.out = nn.Linear(dim, dim)
        self.tol = tol
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x)
        delta = torch.tensor(float("inf"))
        i = torch.zeros(())
        while (delta > self.tol) & (i < self.limit):
            new = torch.tanh(self.w(h) + x)
            delta = (new - h).abs().max()
            h = new
            i = i + 1
        return self.out(h)


class HaltingLoop(nn.Module):
    """Adaptive computation time written as a `while`: refine while some row has not
    halted; a branch inside the loop body (an `if` on a tensor in a `while`)."""

    def __init__(self, dim: int = HIDDEN, eps: float = 0.01) -> None:
        super().__init__()
        self.cell = nn.Linear(dim, dim)
        self.halt = nn.Linear(dim, 1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = x
        halted = torch.zeros(x.shape[0], 1)
        while (halted < 1 - self.eps).any():
            p = torch.sigmoid(self.halt(state)).clamp(min=0.2)
            running = (halted < 1 - self.eps).float()
            update = torch.tanh(self.cell(state))
            if update.abs().max() > 0.9:
                update = update * 0.5
            state = state + running * update
            halted = halted + running * p
        return state


# -- refused: they fall back, with a reason ------------------------------------------------

TRACE_LOG: list = []


class CountsSkips(nn.Module):
    """Writes module state in a side."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() < 0:
            self.skipped = self.skipped + 1
            x = x.abs()
        return x * 2


class LogsToGlobalList(nn.Module):
    """Appends to a global list in a side."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            TRACE_LOG.append("positive")
            x = x + 1
        return x


class OptionalOutput(nn.Module):
    """One side gives a tensor, the other None."""

    def forward(self, x: torch.Tensor) -> tuple:
        aux = None
        if x.mean() > 0:
            aux = x.sum(0)
        return x * 2, aux


class BeamSearchWhile(nn.Module):
    """A `while` loop on a tensor test (beam-search style: extend while any beam is
    unfinished, at most `steps` times)."""

    def __init__(self, vocab: int = 8, steps: int = 5) -> None:
        super().__init__()
        self.step = nn.Linear(vocab, vocab)
        self.steps = steps

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        done = torch.zeros(logits.shape[0], dtype=torch.bool)
        n = 0
        while not done.all() and n < self.steps:
            logits = self.step(logits.softmax(-1))
            done = done | (logits.argmax(-1) == 0)
            n += 1
        return logits


class GrowingBeam(nn.Module):
    """A decoding loop that appends a token per step: what it carries grows, which a
    while_loop cannot hold (it must fall back, saying which variable changed shape)."""

    def __init__(self, vocab: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        while ((tokens[:, -1] != 0) & (tokens.shape[1] < 6)).any():
            nxt = self.embed(tokens[:, -1]).argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
        return tokens


class StopsEarly(nn.Module):
    """A `while` on a tensor whose body can `break` out: the loop ends other than by its
    test, which a while_loop cannot say."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        while x.abs().sum() > 1:
            x = x * 0.5
            if x.max() < 0.1:
                break
        return x


class DifferentPythonValues(nn.Module):
    """The sides give a Python number the rest of the forward uses."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            scale = 2
        else:
            scale = 3
        return (x * scale).relu()    # a tail long enough that 3.12+ do not copy it


# name -> (factory, list of argument tuples that together take every side)
def _inputs_moe() -> list:
    torch.manual_seed(1)
    same = torch.randn(1, HIDDEN).expand(8, HIDDEN).clone()   # every token to one expert
    return [(torch.randn(8, HIDDEN),), (same,), (torch.randn(8, HIDDEN) * 3,)]


SUITE: dict[str, tuple[Callable[[], nn.Module], Callable[[], list]]] = {
    "moe_mask_any": (MoEMaskAny, _inputs_moe),
    "moe_gather": (MoEGather, _inputs_moe),
    "early_exit": (lambda: EarlyExit(threshold=0.3),
                   lambda: [(torch.randn(4, HIDDEN) * 0.01,), (torch.randn(4, HIDDEN) * 50,),
                            (torch.randn(4, HIDDEN),)]),
    "adaptive_computation": (AdaptiveComputation,
                             lambda: [(torch.randn(4, HIDDEN),), (torch.randn(4, HIDDEN) * 10,)]),
    "nan_guard": (NaNGuard, lambda: [(torch.rand(4, HIDDEN) + 0.5,),
                                     (torch.randn(4, HIDDEN),), (torch.rand(4, HIDDEN) + 0.1,)]),
    "overflow_guard": (OverflowGuard, lambda: [(torch.randn(4, HIDDEN),),
                                               (torch.randn(4, HIDDEN) * 1000,)]),
    "padding_mask": (PaddingMask, lambda: [
        (torch.randn(3, 6, HIDDEN), torch.tensor([6, 6, 6])),
        (torch.randn(3, 6, HIDDEN), torch.tensor([6, 2, 4])),
        (torch.randn(3, 6, HIDDEN), torch.tensor([1, 6, 6]))]),
    "nested_elif": (NestedElif, lambda: [(torch.randn(4, HIDDEN) * s,) for s in
                                         (0.1, 1.0, -1.0, 1.5, 10.0)]),
    "gated_block": (GatedBlock, lambda: [(torch.randn(4, HIDDEN) * s,) for s in
                                         (1.0, -1.0, 20.0, -20.0, 0.1)]),
    "safe_normalize": (SafeNormalize, lambda: [(torch.randn(4, HIDDEN),),
                                               (torch.full((4, HIDDEN), 3.0),)]),
    "layer_skip": (LayerSkip, lambda: [(torch.randn(4, HIDDEN),), (torch.randn(4, HIDDEN) * 0.01,),
                                       (torch.randn(4, HIDDEN) * 100,)]),
    "clamped_topk": (ClampedTopK, lambda: [(torch.randn(4, 10),), (-torch.rand(4, 10) - 0.1,)]),
    "residual_scale": (ResidualScale, lambda: [(torch.randn(4, HIDDEN) * s,) for s in
                                               (1.0, -1.0, 3.0)]),
    "beam_search_fixed": (BeamSearchFixed, lambda: [
        (torch.randn(3, 8),), (torch.randn(3, 8) * 4,),
        (torch.tensor([[5.0] + [0.0] * 7] * 3),)]),          # all done: zero iterations
    "fixed_point_solve": (FixedPointSolve, lambda: [(torch.randn(4, HIDDEN),),
                                                    (torch.randn(4, HIDDEN) * 0.01,)]),
    "halting_loop": (HaltingLoop, lambda: [(torch.randn(4, HIDDEN),),
                                           (torch.randn(4, HIDDEN) * 10,)]),
}

# name -> (factory, inputs, words the fallback reason holds)
REFUSED: dict[str, tuple[Callable[[], nn.Module], Callable[[], list], str]] = {
    "counts_skips": (CountsSkips, lambda: [(torch.randn(3, 4),)], "write to module state"),
    "logs_to_global_list": (LogsToGlobalList, lambda: [(torch.randn(3, 4),)],
                            "list.append on an object made outside the branch"),
    "optional_output": (OptionalOutput, lambda: [(torch.randn(3, 4),)],
                        "different structures"),
    "beam_search_while": (BeamSearchWhile, lambda: [(torch.randn(2, 8),)], "while"),
    "stops_early": (StopsEarly, lambda: [(torch.randn(3, 4) * 4,), (torch.rand(3, 4) * 0.3,)],
                    "while"),
    "growing_beam": (GrowingBeam, lambda: [(torch.tensor([[3], [5]]),)],
                     "'tokens' changes shape in an iteration"),
    "different_python_values": (DifferentPythonValues, lambda: [(torch.randn(3, 4),)],
                                "different Python values"),
}

del math
