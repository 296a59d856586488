"""Release what torch.fx keeps for every GraphModule it compiles.

GraphModule.recompile() stores the generated source in a process-wide cache
(`torch.fx.graph_module._loader.eval_cache`) and in `linecache`, under a fresh
`<eval_with_key>.N` name, and never removes either.  A recapture makes a new
GraphModule, so without this each recapture would leave a source string behind.
"""
from __future__ import annotations

import linecache
import weakref

import torch.fx


def _drop(key: str) -> None:
    loader = getattr(torch.fx.graph_module, "_loader", None)
    cache = getattr(loader, "eval_cache", None)
    if isinstance(cache, dict):
        cache.pop(key, None)
    linecache.cache.pop(key, None)


def release_source_with(gm: torch.fx.GraphModule) -> None:
    """Drop `gm`'s cached source when `gm` is collected."""
    code = getattr(type(gm).forward, "__code__", None) or getattr(gm.forward, "__code__", None)
    key = getattr(code, "co_filename", "")
    if key.startswith("<eval_with_key>"):
        weakref.finalize(gm, _drop, key)
