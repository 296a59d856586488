"""The bytecode rewrite on real code: large stdlib modules and torch.nn.

1. Every code object of the corpus goes through the instruction-list layer unchanged
   (decode + assemble reproduces co_code, co_linetable, co_exceptiontable and
   co_stacksize byte for byte), and through the rewrite untouched (no site: the very
   same object back), also with the "training" pre-filter defeated.
2. The same sources with every name or attribute test of a conditional expression
   (and of an `if` statement) replaced by `self.training`: real-world shapes of qualifying and
   non-qualifying sites.  Each code object's site count must equal an AST count; each
   rewritten code object must disassemble, have a stack size equal to an independent
   flow analysis, use only the original's positions, and come back unchanged from a
   second rewrite and from a decode/assemble round trip.
3. torch.nn: every Module subclass's forward rewrites; those that can be built with
   no arguments and fed one small random tensor give the same outputs with the
   rewritten forward as eagerly, in train and eval mode, under one seed.

The time spent in the rewrite per code object is printed (pytest -s).
"""
from __future__ import annotations

import ast
import dis
import functools
import glob
import importlib.util
import io
import os
import time
import sysconfig
import types
import warnings

import pytest
from rewrite_util import nested_codes, rewrite, stack_depth

from nnscaler_eval import _C

STDLIB = ["typing", "argparse", "inspect", "email.message", "pydoc", "tkinter",
          "tkinter.ttk", "dataclasses", "asyncio.base_events", "unittest.mock", "logging",
          "http.client", "difflib", "tarfile", "zipfile", "configparser", "optparse",
          "threading", "subprocess", "pathlib", "statistics", "_pydecimal", "turtle",
          "idlelib.editor"]
# Files found by path, first existing one of each row: a file CPython moved between
# versions stays in the corpus (importing `test.test_ttk` to find it would need a display).
STDLIB_PATHS = [("tkinter/test/test_ttk/test_widgets.py", "test/test_ttk/test_widgets.py")]

TIMINGS = {"code_objects": 0, "seconds": 0.0, "rewritten": 0, "rewritten_seconds": 0.0}


def corpus_files():
    files = []
    for name in STDLIB:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            files.append(spec.origin)
    stdlib = sysconfig.get_paths()["stdlib"]
    for candidates in STDLIB_PATHS:
        found = [os.path.join(stdlib, c) for c in candidates
                 if os.path.exists(os.path.join(stdlib, c))]
        files += found[:1]
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is not None:
        root = os.path.dirname(torch_spec.origin)
        files += sorted(glob.glob(os.path.join(root, "nn", "modules", "*.py")))
        files += [os.path.join(root, "nn", "functional.py"),
                  os.path.join(root, "ao", "nn", "intrinsic", "qat", "modules", "conv_fused.py"),
                  os.path.join(root, "ao", "nn", "intrinsic", "qat", "modules", "linear_fused.py")]
    return [f for f in files if os.path.exists(f)]


def torch_files(*patterns):
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return []
    root = os.path.dirname(spec.origin)
    return sorted(f for pattern in patterns for f in glob.glob(os.path.join(root, pattern)))


def short_name(path):
    return os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))


FILES = corpus_files()
# the renamed corpus adds code dense in conditional expressions on attributes
RENAMED_FILES = FILES + torch_files("optim/*.py", "nn/utils/*.py", "fx/*.py")


def timed_rewrite(code):
    started = time.perf_counter()
    result = rewrite(code)
    elapsed = time.perf_counter() - started
    TIMINGS["code_objects"] += 1
    TIMINGS["seconds"] += elapsed
    if result[1]:
        TIMINGS["rewritten"] += 1
        TIMINGS["rewritten_seconds"] += elapsed
    return result


def assert_roundtrip(code, where):
    back = _C._bytecode_roundtrip(code)
    for field in ("co_code", "co_linetable", "co_exceptiontable", "co_stacksize"):
        assert getattr(back, field) == getattr(code, field), f"{where}: {field} changed"


@pytest.fixture(scope="module", autouse=True)
def report_timing():
    yield
    if TIMINGS["code_objects"]:
        print(f"\nrewrite: {TIMINGS['code_objects']} code objects in "
              f"{TIMINGS['seconds'] * 1e3:.1f} ms "
              f"({TIMINGS['seconds'] / TIMINGS['code_objects'] * 1e6:.2f} us each); "
              f"{TIMINGS['rewritten']} rewritten, "
              f"{TIMINGS['rewritten_seconds'] / max(TIMINGS['rewritten'], 1) * 1e6:.1f} us each")


# ---------------------------------------------------------------- 1. unchanged corpus

@pytest.mark.parametrize("path", FILES, ids=short_name)
def test_corpus_untouched(path):
    with open(path, encoding="utf-8") as f:
        top = compile(f.read(), path, "exec")
    for code in nested_codes(top):
        where = f"{code.co_qualname} at {path}:{code.co_firstlineno}"
        assert_roundtrip(code, where)
        new, n_sites = timed_rewrite(code)
        if "training" not in code.co_names:
            assert (new, n_sites) == (code, 0), where
            assert new is code
            # the full matcher, not just the pre-filter, finds nothing either
            forced = code.replace(co_names=code.co_names + ("training",))
            new, n_sites = timed_rewrite(forced)
            assert n_sites == 0 and new is forced, where


# ---------------------------------------------------------------- 2. renamed corpus

def rename_tests(tree):
    """Every conditional expression whose test is a name or an attribute load (under
    any `not`s) gets `self.training` as its test instead, and so does every `if`
    statement of that form (those must stay untouched).  The branches keep their
    real-world shapes.  Edits `tree` in place and returns it."""
    for node in ast.walk(tree):
        if not isinstance(node, (ast.IfExp, ast.If)):
            continue
        parent, test = node, node.test
        while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            parent, test = test, test.operand
        if isinstance(test, (ast.Name, ast.Attribute)):
            name = ast.copy_location(ast.Name(id="self", ctx=ast.Load()), test)
            new = ast.copy_location(ast.Attribute(value=name, attr="training",
                                                  ctx=ast.Load()), test)
            if parent is node:
                node.test = new
            else:
                parent.operand = new
    return tree


FORBIDDEN = (ast.Call, ast.NamedExpr, ast.ListComp, ast.SetComp, ast.DictComp,
             ast.GeneratorExp, ast.Yield, ast.YieldFrom, ast.Await)
COMPREHENSIONS = {ast.ListComp: "<listcomp>", ast.SetComp: "<setcomp>",
                  ast.DictComp: "<dictcomp>", ast.GeneratorExp: "<genexpr>"}


def is_training_test(node):
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        node = node.operand
    return (isinstance(node, ast.Attribute) and node.attr == "training"
            and isinstance(node.value, ast.Name) and node.value.id == "self")


def has_forbidden(node):
    if isinstance(node, FORBIDDEN):
        return True
    if isinstance(node, ast.Lambda):
        return any(has_forbidden(d) for d in node.args.defaults + node.args.kw_defaults if d)
    return any(has_forbidden(child) for child in ast.iter_child_nodes(node))


def first_line(node):
    decorators = getattr(node, "decorator_list", None)
    return min([node.lineno] + [d.lineno for d in decorators or []])


class ModuleSites:
    """Qualifying sites per code object, keyed (co_name, co_firstlineno), from the AST.

    A scope qualifies when `self` compiles to LOAD_FAST / LOAD_DEREF /
    LOAD_CLASSDEREF in it: a function with a `self` parameter, or any scope nested in
    one.  Counts are marked inexact where the compiler's copies of code are not
    modelled: a `finally` body (copied once per way out of the `try`), and a bare
    expression statement (its join is copied before an implicit exit; see
    test_rewrite.py::test_discarded_value_before_implicit_exit).
    """

    def __init__(self, tree):
        self.counts = {}
        self.inexact = set()
        self.key = ("<module>", 1)
        self.self_ok = False
        self.copies = 1
        for stmt in tree.body:
            self.stmt(stmt)

    def add_site(self):
        self.counts[self.key] = self.counts.get(self.key, 0) + self.copies

    def scope(self, key, self_ok, visit_body):
        saved = (self.key, self.self_ok, self.copies)
        self.key, self.self_ok, self.copies = key, self_ok, 1
        self.counts.setdefault(key, 0)
        try:
            visit_body()
        finally:
            self.key, self.self_ok, self.copies = saved

    def stmts(self, body):
        return lambda: [self.stmt(s) for s in body]

    def arguments(self, args):
        for default in args.defaults + args.kw_defaults:
            if default is not None:
                self.expr(default, False)

    def stmt(self, s):
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in s.decorator_list:
                self.expr(d, False)
            self.arguments(s.args)
            all_args = s.args.posonlyargs + s.args.args + s.args.kwonlyargs
            has_self = any(a.arg == "self" for a in all_args)
            self.scope((s.name, first_line(s)), self.self_ok or has_self, self.stmts(s.body))
        elif isinstance(s, ast.ClassDef):
            for node in s.decorator_list + s.bases + [k.value for k in s.keywords]:
                self.expr(node, False)
            self.scope((s.name, first_line(s)), self.self_ok, self.stmts(s.body))
        elif isinstance(s, ast.If):
            self.expr(s.test, True)
            for child in s.body + s.orelse:
                self.stmt(child)
        elif isinstance(s, ast.While):
            saved = self.copies
            self.copies *= 2    # the test is compiled before the loop and at its bottom
            self.expr(s.test, True)
            self.copies = saved
            for child in s.body + s.orelse:
                self.stmt(child)
        elif isinstance(s, ast.Assert):
            self.expr(s.test, True)
            if s.msg is not None:
                self.expr(s.msg, False)
        elif isinstance(s, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            for child in s.body + s.orelse:
                self.stmt(child)
            for handler in s.handlers:
                if handler.type is not None:
                    self.expr(handler.type, False)
                for child in handler.body:
                    self.stmt(child)
            if s.finalbody:
                before = dict(self.counts)
                for child in s.finalbody:
                    self.stmt(child)
                if self.counts != before:
                    self.inexact.add(self.key)
        elif isinstance(s, ast.Expr) and isinstance(s.value, ast.IfExp):
            before = self.counts.get(self.key, 0)
            self.expr(s.value, False)
            if self.counts.get(self.key, 0) != before:
                self.inexact.add(self.key)
        else:
            self.generic(s)

    def generic(self, node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                self.stmt(child)
            elif isinstance(child, ast.expr):
                self.expr(child, False)
            else:
                self.generic(child)

    def expr(self, e, jump):
        if isinstance(e, ast.IfExp):
            self.expr(e.test, True)
            self.expr(e.body, jump)
            self.expr(e.orelse, jump)
            if (not jump and self.self_ok and is_training_test(e.test)
                    and not has_forbidden(e.body) and not has_forbidden(e.orelse)):
                self.add_site()
        elif isinstance(e, ast.BoolOp):
            for value in e.values:
                self.expr(value, jump)
        elif isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            self.expr(e.operand, jump)
        elif isinstance(e, ast.Lambda):
            self.arguments(e.args)
            self.scope(("<lambda>", e.lineno), self.self_ok,
                       lambda: self.expr(e.body, False))
        elif type(e) in COMPREHENSIONS:
            # the first iterable runs in this scope, the rest in the comprehension's
            self.expr(e.generators[0].iter, False)

            def body():
                for i, gen in enumerate(e.generators):
                    if i:
                        self.expr(gen.iter, False)
                    for cond in gen.ifs:
                        self.expr(cond, True)
                for node in [e.key, e.value] if isinstance(e, ast.DictComp) else [e.elt]:
                    self.expr(node, False)

            self.scope((COMPREHENSIONS[type(e)], e.lineno), self.self_ok, body)
        else:
            self.generic(e)


def check_rewritten(code, new, where):
    out = io.StringIO()
    dis.dis(new, file=out)
    assert "ifexpr" in out.getvalue(), where
    assert new.co_stacksize == stack_depth(new), where
    assert set(new.co_positions()) <= set(code.co_positions()), where
    again, n_again = rewrite(new)
    assert n_again == 0 and again is new, where
    assert_roundtrip(new, where)


@functools.cache
def renamed_corpus(path):
    """(compiled renamed module, expected sites per (co_name, co_firstlineno), keys
    whose count is not modelled exactly)."""
    with open(path, encoding="utf-8") as f:
        tree = rename_tests(ast.parse(f.read(), path))
    expected = ModuleSites(tree)
    return compile(tree, path, "exec"), expected.counts, expected.inexact


@pytest.mark.parametrize("path", RENAMED_FILES, ids=short_name)
def test_corpus_renamed_to_training(path):
    top, expected, inexact = renamed_corpus(path)
    got = {}
    for code in nested_codes(top):
        where = f"{code.co_qualname} at {path}:{code.co_firstlineno}"
        new, n_sites = timed_rewrite(code)
        key = (code.co_name, code.co_firstlineno)
        got[key] = got.get(key, 0) + n_sites
        if n_sites:
            check_rewritten(code, new, where)
        else:
            assert new is code, where
    mismatches = {key: (got.get(key, 0), count) for key, count in expected.items()
                  if key not in inexact and got.get(key, 0) != count}
    mismatches.update({key: (n, 0) for key, n in got.items() if n and key not in expected})
    assert not mismatches, f"{path}: (rewritten, AST) per (code, line): {mismatches}"


def test_corpus_has_sites():
    """The renamed corpus is worth its time: it holds many qualifying sites, few of
    them in places whose count is not modelled."""
    total = inexact = 0
    for path in RENAMED_FILES:
        _, expected, not_modelled = renamed_corpus(path)
        total += sum(expected.values())
        inexact += sum(expected[key] for key in not_modelled)
    assert total >= 60 and inexact <= total // 10, (total, inexact)


# ---------------------------------------------------------------- 3. torch.nn

torch = pytest.importorskip("torch")


def nn_module_classes():
    for name in sorted(dir(torch.nn)):
        cls = getattr(torch.nn, name)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            yield name, cls


def python_forward(cls):
    forward = getattr(cls, "forward", None)
    return forward if isinstance(forward, types.FunctionType) else None


def test_torch_nn_forwards_rewrite():
    seen = 0
    for name, cls in nn_module_classes():
        forward = python_forward(cls)
        if forward is None:
            continue
        seen += 1
        code = forward.__code__
        new, n_sites = timed_rewrite(code)
        if n_sites:
            check_rewritten(code, new, f"torch.nn.{name}.forward")
        else:
            assert new is code
    assert seen > 100


def rewritten_method(fn, obj):
    code, n_sites = rewrite(fn.__code__)
    new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return types.MethodType(new, obj), n_sites


SHAPES = [(2, 8), (2, 3, 8), (2, 3, 4, 4), (2, 3, 4, 4, 4), (8,), (2, 1, 8), (2, 16, 8)]


def same(expected, got):
    try:
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    except AssertionError:
        return False
    return True


def fed_nn_modules():
    """(name, module, example input) for each torch.nn module with a Python forward
    that builds with default arguments and accepts one of SHAPES."""
    fed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, cls in nn_module_classes():
            if python_forward(cls) is None:
                continue
            try:
                module = cls()
            except Exception:
                continue
            gen = torch.Generator().manual_seed(0)
            for shape in SHAPES:
                x = torch.rand(shape, generator=gen) * 2 - 0.5
                try:
                    module.eval()
                    with torch.no_grad():
                        module(x)
                except Exception:
                    continue
                fed.append((name, module, x))
                break
    return fed


def test_torch_nn_modules_same_outputs():
    fed = fed_nn_modules()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, module, example in fed:
            forward, _ = rewritten_method(type(module).forward, module)
            for train in (True, False):
                module.train(train)
                torch.manual_seed(7)
                expected = module(example)
                torch.manual_seed(7)
                got = forward(example)
                assert same(expected, got), f"torch.nn.{name} (train={train})"
    names = [name for name, _, _ in fed]
    assert len(names) >= 30, names
    for name in ("Dropout", "ReLU", "Softmax", "Identity", "Flatten"):
        assert name in names


def test_torch_nn_modules_same_outputs_under_rewrite_mode():
    """The same modules called normally inside `nnscaler.eval_frame.enable()`: the C
    hook runs their rewritten forwards (and every helper they call)."""
    import nnscaler

    fed = fed_nn_modules()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, module, example in fed:
            for train in (True, False):
                module.train(train)
                torch.manual_seed(7)
                expected = module(example)
                torch.manual_seed(7)
                with nnscaler.eval_frame.enable():
                    got = module(example)
                assert same(expected, got), f"torch.nn.{name} (train={train})"
    assert len(fed) >= 30
