"""`nnscaler_eval/_C.pyi` (shipped with `py.typed`) against the built `_C`: every name
it declares exists, every attribute it gives a class is on the class, and where the C
docstring opens with a signature (`name(a, b=..., /, *args)`), the stub's parameters
are the same names in the same order."""
from __future__ import annotations

import ast
import os
import re

import pytest

from nnscaler_eval import _C

STUB = os.path.join(os.path.dirname(_C.__file__), "_C.pyi")


def _stub() -> ast.Module:
    with open(STUB, encoding="utf-8") as f:
        return ast.parse(f.read(), STUB)


def _stub_params(fn: ast.FunctionDef, method: bool) -> list[str]:
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if method:
        names = names[1:]   # self
    if args.vararg is not None:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg is not None:
        names.append("**" + args.kwarg.arg)
    return names


_SIGNATURE = re.compile(r"^\s*(\w+)\((.*?)\)", re.S)


def _documented_params(obj: object, name: str) -> list[str] | None:
    """The parameter names of the signature `obj`'s docstring opens with, if it does."""
    match = _SIGNATURE.match(getattr(obj, "__doc__", None) or "")
    if match is None or match.group(1) != name:
        return None
    params = []
    for part in match.group(2).replace("\n", " ").split(","):
        part = part.split("=")[0].strip()
        if part and part not in ("/", "*"):   # markers, not parameters
            params.append(part)
    return params


def _declared():
    tree = _stub()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node, None
        elif isinstance(node, ast.ClassDef):
            yield node.name, None, node


@pytest.mark.parametrize("name,fn,cls", list(_declared()), ids=lambda v: v if isinstance(v, str) else "")
def test_stub_matches_the_module(name, fn, cls):
    assert hasattr(_C, name), f"_C.pyi declares {name}, which _C does not have"
    obj = getattr(_C, name)
    if fn is not None:
        documented = _documented_params(obj, name)
        if documented is not None:
            assert _stub_params(fn, method=False) == documented, name
        return
    for item in cls.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            assert hasattr(obj, item.target.id), f"_C.{name} has no attribute {item.target.id}"
        elif isinstance(item, ast.FunctionDef):
            if item.name == "__init__":
                documented = _documented_params(obj, name)
                if documented is not None:
                    assert _stub_params(item, method=True) == documented, f"{name}.__init__"
            else:
                assert hasattr(obj, item.name), f"_C.{name} has no method {item.name}"


def test_every_documented_function_is_in_the_stub():
    declared = {name for name, _, _ in _declared()}
    public = {n for n in dir(_C) if not n.startswith("_") and callable(getattr(_C, n))}
    missing = sorted(public - declared)
    assert not missing, f"_C has names the stub does not declare: {missing}"
