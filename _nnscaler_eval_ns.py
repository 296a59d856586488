"""How nnscaler-eval provides the `nnscaler.*` names without owning nnScaler's files.

Microsoft nnScaler's distribution owns the `nnscaler` package (`nnscaler/__init__.py`,
`nnscaler/runtime/...`). Two distributions that both ship those files overwrite each
other without a word from pip, and uninstalling one deletes files the other needs. So
this distribution ships no `nnscaler/` directory at all. It ships this module and
`nnscaler_eval_ns.pth`, which runs `install()` at interpreter start-up; `install()` only
puts a finder at the front of `sys.meta_path` (no torch, nothing else imported). When
`nnscaler` is first imported, the finder:

- asks the other finders for `nnscaler`. If one finds it (nnScaler is installed), that
  package is imported unchanged and, once its `__init__` has run, our public names are
  added onto it (`nnscaler_eval._nnscaler_extend`): `compile`, `export`, `explain`, ...,
  and the submodule `nnscaler.eval_frame`. nnScaler's own names are never replaced
  (`register_op` stays nnScaler's; its registry hands each function to ours);
- otherwise imports our own package, `nnscaler_eval/_nnscaler/`, under the name
  `nnscaler` (what `import nnscaler` gave before nnScaler could be installed beside us).

Uninstalling nnscaler-eval removes this module and the .pth: nnScaler is untouched.
Uninstalling nnScaler leaves the finder to fall back on our package.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from typing import Any, Optional, Sequence

_PACKAGE = "nnscaler"


class _ExtendingLoader(importlib.abc.Loader):
    """nnScaler's own loader, plus our names added once its package has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            from nnscaler_eval import _nnscaler_extend

            _nnscaler_extend.extend(module)
        except Exception as exc:  # ours is broken: nnScaler's package still works
            warnings.warn(f"nnscaler-eval could not add its names to nnScaler's package: "
                          f"{exc!r}", RuntimeWarning, stacklevel=2)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, resource readers
        return getattr(self._loader, name)


class NnscalerFinder(importlib.abc.MetaPathFinder):
    """Finds `nnscaler`: nnScaler's package extended with ours, or ours alone."""

    _nnscaler_eval_finder = True

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != _PACKAGE:
            return None
        spec = _find_with_others(fullname, path, target)
        if spec is not None:
            if spec.loader is not None and not isinstance(spec.loader, _ExtendingLoader):
                spec.loader = _ExtendingLoader(spec.loader)
            return spec
        return fallback_spec()


def _find_with_others(fullname: str, path: Any, target: Any) -> Any:
    for finder in list(sys.meta_path):
        if getattr(finder, "_nnscaler_eval_finder", False):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def fallback_dir() -> Optional[str]:
    """Where our own `nnscaler` package lives (`nnscaler_eval/_nnscaler`), found
    without importing nnscaler_eval."""
    spec = importlib.util.find_spec("nnscaler_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, "_nnscaler")
        if os.path.isfile(os.path.join(candidate, "__init__.py")):
            return candidate
    return None


def fallback_spec() -> Optional[importlib.machinery.ModuleSpec]:
    directory = fallback_dir()
    if directory is None:
        return None
    return importlib.util.spec_from_file_location(
        _PACKAGE, os.path.join(directory, "__init__.py"), submodule_search_locations=[directory])


def install() -> None:
    """Put the finder first on sys.meta_path (once)."""
    if not any(getattr(f, "_nnscaler_eval_finder", False) for f in sys.meta_path):
        sys.meta_path.insert(0, NnscalerFinder())
