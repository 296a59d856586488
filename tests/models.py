"""Models shared by the capture tests and the demo-like checks."""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class Block(nn.Module):
    """Transformer block: nn.Dropout, LayerNorm, SDPA whose dropout_p is a
    self.training expression."""

    def __init__(self, d: int = 32, heads: int = 4, p: float = 0.2) -> None:
        super().__init__()
        self.heads, self.dropout = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None,
            dropout_p=self.dropout if self.training else 0,
            is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.drop(self.mlp(self.ln2(x)))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


class Branchy(nn.Module):
    """Uses self.training for branching: one graph per mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if self.training:
            return self.lin(x) * 2
        return self.lin(x)


class ValueOnly(nn.Module):
    """Uses self.training only as a value: one graph for both modes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.p = 0.5

    def forward(self, x):
        y = F.dropout(self.lin(x), 0.3, self.training)
        return y * (self.p if self.training else 1.0)


def meddling_training(meddle) -> property:
    """A `training` property that calls `meddle(module)` before answering: Python in
    the middle of whatever reads the flag (the guards on a hit, the tracer on a
    capture). The flag itself lives in `__dict__["_mode"]`."""

    def get(self):
        meddle(self)
        return self.__dict__.get("_mode", True)

    def set_(self, value):
        self.__dict__["_mode"] = value

    return property(get, set_)
