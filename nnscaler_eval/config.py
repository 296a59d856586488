"""The options of one `nnscaler.compile(...)` / `enable(backend=...)`, checked once."""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from nnscaler_eval import _C
from nnscaler_eval.runners.backends import resolve_backend


@dataclass(frozen=True, eq=False)
class CompileConfig:
    backend: Any
    fullgraph: bool = False
    skip_nnmodule_hook_guards: bool = False
    cache_size_limit: int = 8
    # Symbolic sizes and int arguments (capture/dynamic.py): None automatic (a size or
    # int seen changing becomes symbolic at the recapture), True symbolic from the
    # first capture, False every capture specialised.
    dynamic: Optional[bool] = None
    # A repeated block compiled once (runners/block_reuse.py): for backends that
    # compile with AOTAutograd, the submodule calls that trace to the same nodes are
    # one subgraph the graph calls per instance.  False: the whole graph inlined.
    block_reuse: bool = True
    # A dynamic capture recorded per size (CUDA graphs) runs a size through the
    # recording of its power-of-two bucket, padded, where the graph allows it
    # (runners/size_buckets.py).
    size_buckets: bool = False
    # None for the built-in "eager" backend (the graph as generated Python).
    backend_fn: Optional[Callable[..., Any]] = field(default=None, repr=False)
    backend_name: str = "eager"
    # Owns the cache buckets made in enable(backend=...) regions armed with this
    # config (a compiled module's or function's own wrapper owns those of its calls):
    # a GC-visible home, so a cycle through a cache entry can be collected.
    cache_home: list = field(default_factory=list, repr=False, compare=False)
    # An enable(backend=...) region's config, shared by every region with equal
    # options (for_region): convert_frame hands each bucket made under it to its
    # module (RegionCaches), so that the caches live and die with the module.
    region: bool = field(default=False, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        backend: Any = "eager",
        fullgraph: bool = False,
        skip_nnmodule_hook_guards: bool = False,
        cache_size_limit: int = 8,
        dynamic: Optional[bool] = None,
        block_reuse: bool = True,
        size_buckets: bool = False,
        **unknown: Any,
    ) -> "CompileConfig":
        if unknown:
            raise TypeError(
                f"nnscaler.compile(): unknown option(s) {', '.join(sorted(unknown))}; "
                "known: backend, fullgraph, skip_nnmodule_hook_guards, cache_size_limit, dynamic, "
                "block_reuse, size_buckets"
            )
        for name, value in (("fullgraph", fullgraph),
                            ("skip_nnmodule_hook_guards", skip_nnmodule_hook_guards),
                            ("block_reuse", block_reuse), ("size_buckets", size_buckets)):
            if not isinstance(value, bool):
                raise TypeError(f"nnscaler.compile(): {name} must be a bool, not {value!r}")
        if isinstance(cache_size_limit, bool) or not isinstance(cache_size_limit, int) \
                or cache_size_limit < 1:
            raise ValueError(
                f"nnscaler.compile(): cache_size_limit must be an int >= 1, not {cache_size_limit!r}"
            )
        if dynamic is not None and not isinstance(dynamic, bool):
            raise TypeError(
                f"nnscaler.compile(): dynamic must be None, True or False, not {dynamic!r}")
        backend_fn, backend_name = resolve_backend(backend)
        return cls(backend, fullgraph, skip_nnmodule_hook_guards, cache_size_limit,
                   dynamic=dynamic, block_reuse=block_reuse, size_buckets=size_buckets,
                   backend_fn=backend_fn,
                   backend_name=backend_name)

    @classmethod
    def for_region(cls, backend: Any, **options: Any) -> "CompileConfig":
        """The config of an `enable(backend=..., **options)` region: one object for
        every region with equal options, so the caches a `with` block made are found
        by the next block with the same options (a new config per block would start
        from empty tables every time).  The buckets it owns die with their owners
        (a module or function captured in a region), not with the region."""
        try:   # the options as written: a block in a loop skips checking them again
            as_written: Any = (_backend_key(backend),
                               tuple(sorted(options.items())) if options else ())
            config = _REGION_CONFIGS.get(as_written)
        except TypeError:   # an unhashable option value: checked (and refused) below
            as_written = config = None
        if config is None:
            checked = cls.create(backend=backend, **options)
            key = (_backend_key(backend), checked.fullgraph,
                   checked.skip_nnmodule_hook_guards, checked.cache_size_limit,
                   checked.dynamic, checked.block_reuse, checked.size_buckets)
            config = _REGION_CONFIGS.get(key)
            if config is None:
                config = dataclasses.replace(checked, region=True)
            _remember_region_config(key, config)
            if as_written is not None:
                _remember_region_config(as_written, config)
        return config

    def arm(self, target: Any = None) -> Any:
        """Arm the current context with this config (`_C.disarm` the token)."""
        return _C.arm(self, target, self.cache_home)

    def __reduce__(self) -> Any:
        return (CompileConfig.create, (self.backend, self.fullgraph,
                                       self.skip_nnmodule_hook_guards, self.cache_size_limit,
                                       self.dynamic, self.block_reuse, self.size_buckets))


class RegionCaches(list):
    """A module's home for the cache buckets made while it was captured in
    `enable(backend=...)` regions, kept in its `__dict__` under REGION_CACHES (as
    `_compiled_call_impl` keeps a compiled module's): the module owns its caches, so
    they die with it, and a cycle through an entry (a hook that is a bound method of
    the module) is one the garbage collector sees.  Copies and pickles of the module
    start with no caches."""

    def __copy__(self) -> "RegionCaches":
        return RegionCaches()

    def __deepcopy__(self, memo: dict) -> "RegionCaches":
        return RegionCaches()

    def __reduce__(self) -> Any:
        return (RegionCaches, ())


REGION_CACHES = "_nnscaler_region_caches"


def adopt_region_bucket(config: CompileConfig, owner: Any, bucket: Any) -> None:
    """Move `bucket` (made under the region config `config` for `owner`) from the
    config's home into the owner module's own; once per bucket."""
    home = config.cache_home
    for i in range(len(home) - 1, -1, -1):
        if home[i] is bucket:
            break
    else:
        return   # adopted already
    caches = owner.__dict__.get(REGION_CACHES)
    if type(caches) is not RegionCaches:
        caches = RegionCaches()
        owner.__dict__[REGION_CACHES] = caches   # not nn.Module.__setattr__: no state write
    caches[:] = [b for b in caches if not getattr(b, "dead", False)]
    caches.append(bucket)
    del home[i]


def _backend_key(backend: Any) -> Any:
    """Equal backends: a name by its text, anything else by identity (a callable
    defines no equality a cache could rely on)."""
    return ("name", backend) if isinstance(backend, str) else ("object", id(backend), backend)


def _remember_region_config(key: Any, config: "CompileConfig") -> None:
    _REGION_CONFIGS[key] = config
    _REGION_CONFIGS.move_to_end(key)
    while len(_REGION_CONFIGS) > _REGION_CONFIGS_KEPT:
        _REGION_CONFIGS.popitem(last=False)   # regions still open keep theirs


# Region configs by options (checked, and as written), oldest first: a config found
# as written is not moved (that lookup is the hot one), so eviction is by age.  Bounded: code that builds a
# new backend callable per block never finds an equal config, and must not make this
# grow without end.  The configs hold their backends; a config dropped from here lives
# on while an open region or a cache entry holds it.
_REGION_CONFIGS: "collections.OrderedDict[Any, CompileConfig]" = collections.OrderedDict()
_REGION_CONFIGS_KEPT = 64
