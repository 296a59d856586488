"""Logging channels, switched on with NNSCALER_LOGS=recaptures,guards,graph,fallbacks,bytecode.

Each channel is a `logging` logger under "nnscaler"; NNSCALER_LOGS sets those
channels to DEBUG and gives the "nnscaler" logger a stderr handler if it has none.
`NNSCALER_LOGS=all` enables every channel.
"""
from __future__ import annotations

import logging
import os

CHANNELS = ("recaptures", "guards", "graph", "fallbacks", "bytecode")

_root = logging.getLogger("nnscaler")


def channel(name: str) -> logging.Logger:
    if name not in CHANNELS:
        raise ValueError(f"unknown log channel {name!r}; channels: {', '.join(CHANNELS)}")
    return _root.getChild(name)


def configure(spec: str | None = None) -> list[str]:
    """Enable the channels named in `spec` (default: $NNSCALER_LOGS); returns them."""
    spec = os.environ.get("NNSCALER_LOGS", "") if spec is None else spec
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["all"]:
        names = list(CHANNELS)
    bad = [n for n in names if n not in CHANNELS]
    if bad:
        raise ValueError(
            f"NNSCALER_LOGS: unknown channel(s) {', '.join(bad)}; channels: {', '.join(CHANNELS)}"
        )
    for name in names:
        channel(name).setLevel(logging.DEBUG)
    if names and not _root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        _root.addHandler(handler)
    return names


recaptures = channel("recaptures")
guards = channel("guards")
graph = channel("graph")
fallbacks = channel("fallbacks")
bytecode = channel("bytecode")
