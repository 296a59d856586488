"""Eager is the oracle: one way for every test to compare a compiled call with eager's.

- `twins(module, **options)`: the module compiled in place, and an eager deep copy
  made before (equal parameters, buffers and state).
- `assert_same(got, want)`: the same structure (types, lengths, keys, None where None)
  and every leaf equal: tensors by shape, dtype and values (exactly, or within
  `rtol`/`atol`; NaN equal to NaN), objects of the same class by their `__dict__` (a
  KV cache each call makes anew), anything else by `==`.  A shorter output, an extra
  key or a tensor where eager returns a number fails, and the message names the path
  (`[1]['logits']`).  `same(got, want)`: the same answer as a bool.
- `agree(compiled, eager, *args, expect=..., **kwargs)`: call both, compare, and
  check how the compiled call was served, from `nnscaler.cache_info`: `"hit"` (a
  cache hit, no capture), `"capture"` (one capture more), `"eager"` (a fallback:
  it ran eagerly), or None (any).  Returns the compiled result.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch
import torch.nn as nn

import nnscaler


def twins(module: nn.Module, **options: Any) -> tuple[nn.Module, nn.Module]:
    eager = copy.deepcopy(module)
    return nnscaler.compile(module, **options), eager


def assert_same(got: Any, want: Any, *, rtol: float = 0.0, atol: float = 0.0,
                path: str = "") -> None:
    where = path or "the output"
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, eager a tensor"
        assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)}, eager {tuple(want.shape)}"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, eager {want.dtype}"
        if got.layout != torch.strided or want.layout != torch.strided:
            got, want = got.to_dense(), want.to_dense()
        try:
            torch.testing.assert_close(got.detach(), want.detach(), rtol=rtol, atol=atol,
                                       equal_nan=True)
        except AssertionError as exc:
            raise AssertionError(f"{where}: values differ from eager's: {exc}") from None
        return
    if dataclasses.is_dataclass(want) and not isinstance(want, type):
        assert type(got) is type(want), f"{where}: {type(got).__name__}, eager {type(want).__name__}"
        for field in dataclasses.fields(want):
            assert_same(getattr(got, field.name), getattr(want, field.name), rtol=rtol,
                        atol=atol, path=f"{path}.{field.name}")
        return
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {type(got).__name__}, eager a dict"
        assert list(got) == list(want), f"{where}: keys {list(got)}, eager {list(want)}"
        for key in want:
            assert_same(got[key], want[key], rtol=rtol, atol=atol, path=f"{path}[{key!r}]")
        return
    if isinstance(want, (tuple, list)):
        assert type(got) is type(want), f"{where}: {type(got).__name__}, eager {type(want).__name__}"
        assert len(got) == len(want), f"{where}: {len(got)} items, eager {len(want)}"
        for index, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, rtol=rtol, atol=atol, path=f"{path}[{index}]")
        return
    if hasattr(want, "__dict__") and not isinstance(want, (type, nn.Module)) and \
            type(want).__eq__ is object.__eq__:
        assert type(got) is type(want), f"{where}: {type(got).__name__}, eager {type(want).__name__}"
        assert_same(vars(got), vars(want), rtol=rtol, atol=atol, path=f"{path}.__dict__")
        return
    assert got == want, f"{where}: {got!r}, eager {want!r}"


def same(got: Any, want: Any, *, rtol: float = 0.0, atol: float = 0.0) -> bool:
    try:
        assert_same(got, want, rtol=rtol, atol=atol)
    except AssertionError:
        return False
    return True


def served(compiled: Any) -> tuple[int, int, int]:
    info = nnscaler.cache_info(compiled)
    return info.captures, info.hits, info.fallbacks


def agree(compiled: Any, eager: Any, *args: Any, expect: Optional[str] = None,
          rtol: float = 0.0, atol: float = 0.0, **kwargs: Any) -> Any:
    before = served(compiled)
    got = compiled(*args, **kwargs)
    want = eager(*args, **kwargs)
    assert_same(got, want, rtol=rtol, atol=atol)
    if expect is not None:
        captures, hits, fallbacks = (a - b for a, b in zip(served(compiled), before))
        how = {"hit": hits > 0 and captures == 0 and fallbacks == 0,
               "capture": captures > 0,
               "eager": fallbacks > 0 and captures == 0}[expect]
        assert how, (f"expected a {expect}; this call made {captures} capture(s), "
                     f"{hits} hit(s), {fallbacks} fallback(s): "
                     f"{nnscaler.cache_info(compiled)}")
    return got
