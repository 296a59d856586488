"""The models the benchmarks run.  All are defined here (not taken from torch.nn
directly) so that every compiler sees a user `forward` frame, as in real use."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """One Linear + ReLU: the unit of the guard-check stacks."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


class Stack(nn.Module):
    """`depth` Blocks in a ModuleList (one Python loop in forward)."""

    def __init__(self, depth: int, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def multi_input_stack(depth: int, n_inputs: int, width: int = 8) -> nn.Module:
    """A Stack whose forward takes `n_inputs` named tensors x0..x{n-1} (summed before
    the blocks), so that the frame's locals are exactly {'self', 'x0', ...}: the
    guards of both systems see one tensor per argument.  Each (depth, n_inputs) gets
    its own class and code object, so caches never mix."""
    names = [f"x{i}" for i in range(n_inputs)]
    src = (f"def forward(self, {', '.join(names)}):\n"
           f"    x = {' + '.join(names)}\n"
           f"    for block in self.blocks:\n"
           f"        x = block(x)\n"
           f"    return x\n")
    namespace: dict = {}
    exec(compile(src, f"<multi_input_stack d{depth} n{n_inputs}>", "exec"), namespace)
    cls = type(f"Stack_d{depth}_n{n_inputs}", (Stack,), {"forward": namespace["forward"]})
    return cls(depth, width)


def passthrough(n_inputs: int) -> nn.Module:
    """A module whose forward(self, x0, ...) returns x0: the cost of calling a module
    with n tensor arguments, and nothing else."""
    names = [f"x{i}" for i in range(n_inputs)]
    namespace: dict = {}
    exec(compile(f"def forward(self, {', '.join(names)}):\n    return x0\n",
                 f"<passthrough n{n_inputs}>", "exec"), namespace)
    return type(f"Passthrough_n{n_inputs}", (nn.Module,), {"forward": namespace["forward"]})()


class MLP(nn.Module):
    def __init__(self, width: int = 128, hidden: int = 512, depth: int = 3,
                 p: float = 0.1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(width if i == 0 else hidden, hidden), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.body(x)))


@dataclass
class GPTConfig:
    vocab: int = 512
    seq: int = 16
    dim: int = 64
    heads: int = 4
    layers: int = 12
    p: float = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.p = cfg.p
        self.resid_drop = nn.Dropout(cfg.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(),
                                 nn.Linear(4 * cfg.dim, cfg.dim), nn.Dropout(cfg.p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT: token + position embeddings, `layers` TransformerBlocks, LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.drop = nn.Dropout(cfg.p)
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --- builders: name -> (module factory, input factory(batch)) -------------------------

def build(name: str, batch: int, seed: int = 0) -> tuple[nn.Module, tuple]:
    """A fresh model (deterministic weights) and its inputs for `batch`."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(), (torch.randn(batch, 128),)
    if name == "block":
        cfg = GPTConfig()
        return TransformerBlock(cfg), (torch.randn(batch, cfg.seq, cfg.dim),)
    if name.startswith("gpt"):
        cfg = GPTConfig(layers=int(name[3:]))
        return GPT(cfg), (torch.randint(0, cfg.vocab, (batch, cfg.seq)),)
    raise KeyError(f"unknown model {name!r}")


MODEL_DESCRIPTIONS = {
    "mlp": "MLP 128-512-512-512-128, GELU, Dropout(0.1)",
    "block": "one transformer block, dim 64, 4 heads, seq 16",
    "gpt2": "small GPT, 2 layers, dim 64, 4 heads, seq 16, vocab 512",
    "gpt12": "small GPT, 12 layers, dim 64, 4 heads, seq 16, vocab 512",
}
