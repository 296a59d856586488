"""Introspection: `cache_info`, `explain`, `reset`."""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple

import torch

from nnscaler_eval.capture import hook_nodes
from nnscaler_eval import _C
from nnscaler_eval.compile_api import compiled_config
from nnscaler_eval.config import CompileConfig
from nnscaler_eval.convert_frame import EntryInfo, collect_captures, known_codes


class CacheInfo(NamedTuple):
    captures: int   # graphs captured (recaptures included)
    hits: int       # calls served by a cached graph
    misses: int     # calls that found no valid entry
    fallbacks: int  # calls run eagerly (graph break recorded, or cache limit reached)
    entries: int    # entries in the cache now


def _forward_codes(module: torch.nn.Module) -> list[Any]:
    """The code objects a call of `module` runs as its forward: the function and, for
    a decorated forward (`functools.wraps`), every function along `__wrapped__` (the
    innermost one is the frame the evaluator intercepts)."""
    forward = module.__dict__.get("forward") or type(module).forward
    forward = getattr(forward, "__func__", forward)
    codes = []
    for _ in range(16):   # a bounded walk: __wrapped__ chains can be cyclic
        code = getattr(forward, "__code__", None)
        if code is not None and code not in codes:
            codes.append(code)
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            break
        forward = getattr(forward, "__func__", forward)
    return codes


def _buckets(obj: Any) -> Iterator[Any]:
    """The cache buckets that belong to `obj` (a module and its submodules, or a
    compiled function)."""
    if isinstance(obj, torch.nn.Module):
        seen: set[int] = set()
        for module in obj.modules():
            for code in _forward_codes(module):
                state = _C.code_state(code)
                for bucket in (state or {}).get("buckets", []):
                    if bucket.self is module and id(bucket) not in seen:
                        seen.add(id(bucket))
                        yield bucket
        return
    fn = obj._nnscaler_fn if isinstance(obj, _C.CompiledFunction) else obj
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:
        raise TypeError(
            f"nnscaler: expected an nn.Module or a (compiled) function, got {type(obj).__name__}"
        )
    state = _C.code_state(code)
    for bucket in (state or {}).get("buckets", []):
        # A function target's bucket is owned by its function object (closures of
        # one code object are different owners).
        if bucket.self is fn:
            yield bucket


def cache_info(obj: Any) -> CacheInfo:
    """Counters of `obj`'s compiled frames (for a module: summed over its submodules)."""
    captures = hits = misses = fallbacks = entries = 0
    for bucket in _buckets(obj):
        captures += bucket.captures
        hits += bucket.hits
        misses += bucket.misses
        fallbacks += bucket.fallbacks
        entries += len(bucket.entries)
    return CacheInfo(captures, hits, misses, fallbacks, entries)


def reset() -> None:
    """Forget every cache entry and counter."""
    for code in list(known_codes):
        _C.clear_cache(code)
    known_codes.clear()
    hook_nodes.forget()


@dataclass
class ExplainReport:
    """What one run captured: graphs (as code), their guards, and fallbacks."""
    entries: list[EntryInfo]
    result: Any = field(repr=False, default=None)

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        return [e.graph_module for e in self.entries if e.graph_module is not None]

    @property
    def guards(self) -> list[list[str]]:
        return [e.key + e.guards for e in self.entries if e.graph_module is not None]

    @property
    def shared_blocks(self) -> list[Any]:
        """Each subgraph compiled once for repeated blocks (`SharedBlock`: its
        identifier, the paths of the modules that share it, their class)."""
        return [b for e in self.entries for b in e.shared_blocks]

    @property
    def fallbacks(self) -> list[Any]:
        return [e.fallback for e in self.entries if e.fallback is not None]

    @property
    def branches(self) -> list[Any]:
        """Each `if` on a tensor met: converted to torch.cond (`converted`), or the
        reason it was not (capture/branches.py, BranchNote)."""
        return [note for e in self.entries for note in e.branches]

    def __str__(self) -> str:
        lines = [f"nnscaler.explain: {len(self.graphs)} graph(s), "
                 f"{len(self.fallbacks)} fallback(s)"]
        for i, entry in enumerate(self.entries):
            if entry.graph_module is not None:
                lines.append(f"\n--- graph {i}: {entry.where} (backend {entry.backend})")
                lines.append(entry.graph_code.strip("\n"))
                lines.append("  guards:")
                lines += [f"    key  {g}" for g in entry.key]
                if entry.symbols:
                    lines.append("  symbolic (the key's sizes and ints below are examples):")
                    lines += [f"    {s}" for s in entry.symbols]
                    lines += [f"    shape {g}" for g in entry.shape_guards]
                    if entry.per_size:
                        lines.append(f"  backend {entry.backend} compiles it once per size: "
                                     f"it refused symbolic inputs ({entry.per_size})")
                        if entry.size_buckets:
                            lines.append(f"  size buckets: {entry.size_buckets}")
                lines += [f"    state {g}" for g in entry.guards]
                if entry.shared_blocks:
                    lines.append(f"  compiled once for repeated blocks (backend "
                                 f"{entry.backend}, block_reuse):")
                    lines += [f"    {block}" for block in entry.shared_blocks]
                if entry.state_writes:
                    lines.append("  state written again on every hit (the forward's writes):")
                    lines += [f"    self{'.' + path if path else ''}.{name} = {value!r}"
                              for path, name, value in entry.state_writes]
                writes = entry.object_writes
                if writes:
                    lines.append("  written into the arguments on every hit (KV caches "
                                 "passed in):")
                    lines += [f"    {w}" for w in writes]
                if entry.branches:
                    lines.append("  `if` statements on tensors:")
                    lines += [f"    {note}" for note in entry.branches]
                if entry.not_guarded:
                    lines.append("  not guarded (beyond the state walk's bounds): "
                                 + ", ".join(entry.not_guarded[:8])
                                 + (" ..." if len(entry.not_guarded) > 8 else ""))
            else:
                lines.append(f"\n--- fallback {i}: {entry.where}")
                lines.append(f"  runs eagerly: {entry.fallback}")
                if entry.branches:
                    lines.append("  `if` statements on tensors:")
                    lines += [f"    {note}" for note in entry.branches]
        return "\n".join(lines)


def explain(obj: Any, *args: Any, **kwargs: Any) -> ExplainReport:
    """Run `obj(*args, **kwargs)` once with fresh caches for `obj` and report what was
    captured.  Caches of `obj` are cleared first (so that every graph is shown)."""
    if not callable(obj):
        raise TypeError(f"nnscaler.explain(): {type(obj).__name__} object is not callable")
    _clear_obj(obj)
    config = compiled_config(obj) or CompileConfig.create()
    with collect_captures() as collector:
        token = config.arm() if compiled_config(obj) is None else None
        try:
            if isinstance(obj, types.FunctionType):
                result = _C.CompiledFunction(obj, config)(*args, **kwargs)
            else:
                result = obj(*args, **kwargs)
        finally:
            if token is not None:
                _C.disarm(token)
    return ExplainReport(collector.entries, result)


def _clear_obj(obj: Any) -> None:
    if isinstance(obj, torch.nn.Module):
        codes = {code for m in obj.modules() for code in _forward_codes(m)}
    else:
        fn = obj._nnscaler_fn if isinstance(obj, _C.CompiledFunction) else obj
        codes = {getattr(getattr(fn, "__func__", fn), "__code__", None)}
    for code in codes:
        if code is not None:
            _C.clear_cache(code)
