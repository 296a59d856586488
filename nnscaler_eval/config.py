"""The options of one `nnscaler.compile(...)` / `enable(backend=...)`, checked once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from nnscaler_eval.backends import resolve_backend


@dataclass(frozen=True, eq=False)
class CompileConfig:
    backend: Any
    fullgraph: bool = False
    skip_nnmodule_hook_guards: bool = False
    cache_size_limit: int = 8
    # None for the built-in "eager" backend (the graph as generated Python).
    backend_fn: Optional[Callable[..., Any]] = field(default=None, repr=False)
    backend_name: str = "eager"
    # Owns the cache buckets made in enable(backend=...) regions armed with this
    # config (a compiled module's or function's own wrapper owns those of its calls):
    # a GC-visible home, so a cycle through a cache entry can be collected.
    cache_home: list = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        backend: Any = "eager",
        fullgraph: bool = False,
        skip_nnmodule_hook_guards: bool = False,
        cache_size_limit: int = 8,
        **unknown: Any,
    ) -> "CompileConfig":
        if unknown:
            raise TypeError(
                f"nnscaler.compile(): unknown option(s) {', '.join(sorted(unknown))}; "
                "known: backend, fullgraph, skip_nnmodule_hook_guards, cache_size_limit"
            )
        for name, value in (("fullgraph", fullgraph),
                            ("skip_nnmodule_hook_guards", skip_nnmodule_hook_guards)):
            if not isinstance(value, bool):
                raise TypeError(f"nnscaler.compile(): {name} must be a bool, not {value!r}")
        if isinstance(cache_size_limit, bool) or not isinstance(cache_size_limit, int) \
                or cache_size_limit < 1:
            raise ValueError(
                f"nnscaler.compile(): cache_size_limit must be an int >= 1, not {cache_size_limit!r}"
            )
        backend_fn, backend_name = resolve_backend(backend)
        return cls(backend, fullgraph, skip_nnmodule_hook_guards, cache_size_limit,
                   backend_fn, backend_name)

    def arm(self, target: Any = None) -> Any:
        """Arm the current context with this config (`_C.disarm` the token)."""
        from nnscaler_eval import _C

        return _C.arm(self, target, self.cache_home)

    def __reduce__(self) -> Any:
        return (CompileConfig.create, (self.backend, self.fullgraph,
                                       self.skip_nnmodule_hook_guards, self.cache_size_limit))
