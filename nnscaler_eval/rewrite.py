"""Views of the bytecode rewrite: the rewritten code object, a function running it,
and a side-by-side `dis` of original and rewritten code (with the rewritten source
where the source file is available).

The rewrite itself is C (csrc/rewrite.c) and works on bytecode; the source shown by
`show_rewrite` is only an illustration produced from the AST with the same rules.
"""
from __future__ import annotations

import ast
import dis
import inspect
import io
import itertools
import textwrap
import types
from typing import Any, Optional

from nnscaler_eval import _C


def _code_of(obj: Any) -> types.CodeType:
    if isinstance(obj, types.CodeType):
        return obj
    obj = getattr(obj, "_nnscaler_fn", obj)
    obj = getattr(obj, "__func__", obj)
    if isinstance(obj, type) and hasattr(obj, "forward"):
        obj = obj.forward
    code = getattr(obj, "__code__", None)
    if code is None:
        raise TypeError(f"nnscaler: expected a function, method or code object, "
                        f"got {type(obj).__name__}")
    return code


def rewritten_code(obj: Any) -> types.CodeType:
    """The code that runs in rewrite mode in place of `obj`'s code (the same code
    object when nothing qualifies).  Rewritten once per code object and cached."""
    code = _code_of(obj)
    state = _C.decide(code)
    return state["rewritten"] or code


def rewritten_function(fn: Any) -> Any:
    """A function like `fn` (same globals, closure, defaults, name) running the
    rewritten code; for a bound method, a bound method of it."""
    if isinstance(fn, types.MethodType):
        return types.MethodType(rewritten_function(fn.__func__), fn.__self__)
    fn = getattr(fn, "_nnscaler_fn", fn)
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"nnscaler.rewritten_function(): expected a function, "
                        f"got {type(fn).__name__}")
    new = types.FunctionType(rewritten_code(fn), fn.__globals__, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__dict__.update(fn.__dict__)
    new.__wrapped__ = fn
    return new


def _is_training(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "training"
            and isinstance(node.value, ast.Name) and node.value.id == "self")


def _has_call(node: ast.AST) -> bool:
    return any(isinstance(n, (ast.Call, ast.NamedExpr)) for n in ast.walk(node))


class _IfExpToCall(ast.NodeTransformer):
    def visit_IfExp(self, node: ast.IfExp) -> ast.AST:
        self.generic_visit(node)
        test, body, orelse = node.test, node.body, node.orelse
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _is_training(test.operand):
            test, body, orelse = test.operand, orelse, body
        if not _is_training(test) or _has_call(body) or _has_call(orelse):
            return node
        func = ast.parse("nnscaler.runtime.function.ifexpr", mode="eval").body
        return ast.copy_location(ast.Call(func=func, args=[test, body, orelse], keywords=[]), node)


def rewritten_source(obj: Any) -> Optional[str]:
    """The source with qualifying expressions shown as `ifexpr` calls, or None when no
    source file is available (the bytecode rewrite does not need one)."""
    try:
        source = textwrap.dedent(inspect.getsource(_code_of(obj)))
    except (OSError, TypeError):
        return None
    tree = ast.fix_missing_locations(_IfExpToCall().visit(ast.parse(source)))
    return ast.unparse(tree)


def show_rewrite(obj: Any, width: int = 60) -> str:
    """Original and rewritten bytecode side by side (and the rewritten source)."""
    original = _code_of(obj)
    new = rewritten_code(obj)

    def listing(code: types.CodeType) -> list[str]:
        out = io.StringIO()
        dis.dis(code, file=out, depth=0)
        return out.getvalue().splitlines()

    left, right = listing(original), listing(new)
    rows = [f"{'original':<{width}} | rewritten ({_C.code_state(original)['n_sites']} site(s))",
            "-" * width + "-+-" + "-" * width]
    for a, b in itertools.zip_longest(left, right, fillvalue=""):
        rows.append(f"{a[:width]:<{width}} | {b[:width]}")
    source = rewritten_source(obj)
    if source is not None:
        rows += ["", "rewritten source (illustration):", source]
    return "\n".join(rows)
