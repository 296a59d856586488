"""The `self.training` conditional-expression rewrite (csrc/rewrite.c), case by case.

Each case compiles real Python, rewrites its code object in C, and runs the result
beside the original in both modes.  The rules come from
shared/seeds/nnscaler-self-training-support.md.
"""
from __future__ import annotations

import contextlib
import dis
import io
import sys
import traceback
import types

import pytest
from rewrite_util import (CALL_OPS, CALL_PREFIX, COND_JUMPS, DROPPED, FAST_LOAD, INSERTED,
                          ifexpr_calls, nested_codes, rewrite, rewritten, stack_depth)

from nnscaler_eval import _C
from nnscaler_eval.runtime import ifexpr


class Mod:
    """Stands in for an nn.Module: anything with a `training` attribute qualifies."""

    def __init__(self, training=True):
        self.training = training
        self.p = 0.5
        self.dropout = 0.1
        self.count = 0


class Obj:
    p = 3
    q = 4


class Recorder:
    """Records the order attributes are read in (both branches run after a rewrite)."""

    def __init__(self):
        self.reads = []

    def __getattr__(self, name):
        self.reads.append(name)
        return name


def both_modes(fn, *args, **kwargs):
    """(result in train mode, result in eval mode) of fn(Mod(mode), *args)."""
    return tuple(fn(Mod(training), *args, **kwargs) for training in (True, False))


def assert_same(fn, *args, sites=1, **kwargs):
    new, n_sites = rewritten(fn)
    assert n_sites == sites
    assert both_modes(new, *args, **kwargs) == both_modes(fn, *args, **kwargs)
    return new


def assert_untouched(fn):
    code, n_sites = rewrite(fn.__code__)
    assert n_sites == 0
    assert code is fn.__code__


def g(x, dropout_p=None, is_causal=False):
    return (x, dropout_p, is_causal)


# ---------------------------------------------------------------- the seeds' rules

def test_constant_branches():
    def f(self):
        return 0.1 if self.training else 0.2

    new = assert_same(f)
    assert both_modes(new) == (0.1, 0.2)
    assert ifexpr_calls(new.__code__) == 1


def test_attribute_and_folded_constant():
    def f(self, x):
        y = x.p if self.training else 0.2 + 0.3
        return y

    new = assert_same(f, Obj())
    assert both_modes(new, Obj()) == (3, 0.5)


@pytest.mark.parametrize("src", [
    "f(x) if self.training else 0.2",
    "0.1 if self.training else f(0.2)",
    "0.1 if self.training else 0.2 + f(0.3)",
    "[v for v in x] if self.training else 0",
    "0 if self.training else (lambda: 1)()",
    "(y := x) if self.training else 0",
    "0 if self.training else {v: 1 for v in x}",
    "x.p if self.training else (yield 1)",
])
def test_branch_with_call_or_store_is_left_alone(src):
    ns = {}
    exec(f"def method(self, x, f=abs):\n    return {src}\n", ns)
    assert_untouched(ns["method"])


def test_not_training_swaps_and_keeps_order():
    def f(self, rec):
        return rec.a if not self.training else rec.b

    new, n_sites = rewritten(f)
    assert n_sites == 1
    for training, expected in ((True, "b"), (False, "a")):
        rec = Recorder()
        assert new(Mod(training), rec) == expected
        # both branches run, in the order they are written
        assert rec.reads == ["a", "b"]
        assert f(Mod(training), Recorder()) == expected
    ops = [ins.opname for ins in dis.get_instructions(new)]
    assert "SWAP" in ops


def test_double_not_is_plain():
    def f(self):
        return 1 if not not self.training else 2

    new = assert_same(f)
    assert "SWAP" not in [ins.opname for ins in dis.get_instructions(new)]


def test_both_branches_evaluated_in_order():
    def f(self, rec):
        return rec.first if self.training else rec.second

    new, _ = rewritten(f)
    rec = Recorder()
    assert new(Mod(False), rec) == "second"
    assert rec.reads == ["first", "second"]


# ---------------------------------------------------------------- nesting

def test_nested_in_true_branch_with_jump_threading():
    def f(self):
        return (1 if self.training else 2) if self.training else 3

    new = assert_same(f, sites=2)
    assert ifexpr_calls(new.__code__) == 2


def test_nested_in_false_branch():
    def f(self, a, b, c):
        return a if self.training else (b if not self.training else c)

    assert_same(f, 1, 2, 3, sites=2)


# 3.12+ copy a small exit block into every branch that jumps to it: a conditional
# expression nested in a branch of the site then has its own copy of the join inside
# the outer branch, and the outer site has no single join: not rewritten (left as
# it is, correct but branching on the flag).  A known gap of the 3.12+ shapes.
COPIED_JOIN_GAP = pytest.mark.xfail(
    sys.version_info >= (3, 12), strict=True,
    reason="3.12+: exit block copied into the branches of a nested conditional "
           "expression; the outer site is not matched")


@COPIED_JOIN_GAP
def test_nested_non_qualifying_ternaries_and_boolops():
    def f(self, a, b, x):
        return (a or b) if self.training else (x if a else b)

    for args in ((0, 5, 9), (1, 5, 9), (0, 0, 9)):
        assert_same(f, *args)


@COPIED_JOIN_GAP
def test_deep_nesting_mixed():
    def f(self, a, b, c):
        return ((a if not self.training else (b and c)) if self.training
                else ((a < b < c) if self.training else (c if a else (b if self.training else a))))

    for args in ((0, 1, 2), (2, 1, 0), (1, 0, 1)):
        assert_same(f, *args, sites=4)


def test_inner_with_call_blocks_outer():
    def f(self, a):
        return (abs(a) if self.training else a) if self.training else 0

    assert_untouched(f)


def test_outer_with_call_keeps_inner():
    def f(self, a):
        return abs(a if self.training else -a) if self.training else 0

    assert_same(f, -4, sites=1)


# ---------------------------------------------------------------- contexts

def test_used_as_if_condition_is_left_alone():
    def f(self, a, b):
        if (a if self.training else b):
            return 1
        return 2

    assert_untouched(f)


def test_discarded_value_before_implicit_exit():
    # A conditional expression whose value is thrown away right before an exit the
    # compiler adds (implicit `return None`, the re-raise of a `finally`) compiles
    # with that exit block copied into its first branch: no join, the same bytecode
    # as `if self.training: a` / `else: b` statements, so it is left alone.  Its value
    # is unused; nothing is lost.
    def tail(self, a, b):
        a if self.training else b

    def in_finally(self, a, b):
        try:
            pass
        finally:
            a if self.training else b
        return a

    def statements(self, a, b):
        if self.training:
            a
        else:
            b

    # (3.14 may borrow the loads of one and not the other: compare them as loads)
    def shape(fn):
        return [(i.opname.replace("_BORROW", ""), i.arg) for i in dis.get_instructions(fn)]
    assert shape(tail) == shape(statements)
    assert_untouched(tail)
    assert_untouched(statements)
    def middle(self, a, b):
        a if self.training else b
        return a

    # 3.11 keeps the value to a POP_TOP after the join: one site (the normal path's
    # copy in `finally`; the exceptional one re-raises from each branch).  3.12+ sink
    # the POP_TOP into both branches and copy `LOAD_FAST a; RETURN_VALUE` into the
    # first: `a; POP_TOP; a | b; POP_TOP; a`, joined at RETURN_VALUE, reads as a site
    # only if its first branch runs on into `return a`, after the condition in the
    # source, as an `if self.training:` statement's body would.  Left alone.
    sites = 1 if sys.version_info < (3, 12) else 0
    assert rewrite(in_finally.__code__)[1] == sites
    assert_same(middle, 1, 2, sites=sites)

    def statement_then_return(self, x):
        try:
            x = x + 1
        finally:
            assert (not self.training) or True
        return x

    # 3.12's copy of `return x` into the assert's true path is the fuzzer's seed 2529
    assert_untouched(statement_then_return)


def test_if_statement_and_boolop_untouched():
    def f(self, x):
        if self.training:
            x = x + 1
        else:
            x = x - 1
        return x

    def h(self, x):
        return self.training and x

    def k(self, x):
        return self.training or x

    def w(self, x):
        while self.training and x > 0:
            x -= 1
        return x

    for fn in (f, h, k, w):
        assert_untouched(fn)


def test_condition_in_boolop_test_untouched():
    def f(self, a, b):
        return a if (self.training or b) else b

    def h(self, a, b):
        return a if (self.training and b) else b

    def k(self, a, b):
        return a if (b and self.training) else b

    for fn in (f, h, k):
        assert_untouched(fn)


def test_try_except_finally():
    def f(self, x):
        try:
            y = x.missing if self.training else 0
        except AttributeError:
            y = "caught"
        finally:
            self.count += 1
        return y

    new, n_sites = rewritten(f)
    assert n_sites == 1
    m = Mod(True)
    assert new(m, Obj()) == "caught" and m.count == 1
    # eval mode: the false branch is 0, but the true branch now runs too (the seeds'
    # documented side effect) and its error is caught by the same handler
    m = Mod(False)
    assert new(m, Obj()) == "caught" and m.count == 1
    assert f(Mod(False), Obj()) == 0
    assert new(Mod(False), types.SimpleNamespace(missing=5)) == 0


def test_handler_in_nested_try_and_with():
    events = []

    @contextlib.contextmanager
    def cm():
        try:
            yield
        except ZeroDivisionError:
            events.append("cm saw")
            raise

    def f(self, a):
        try:
            with cm():
                for i in range(2):
                    try:
                        v = (1 // a) if self.training else a
                    except TypeError:
                        v = None
        except ZeroDivisionError:
            return "outer"
        return v

    new, n_sites = rewritten(f)
    assert n_sites == 1
    assert both_modes(new, 2) == both_modes(f, 2)
    events.clear()
    assert new(Mod(False), 0) == "outer"
    assert events == ["cm saw"]
    assert new(Mod(True), "s") is None


def test_loops():
    def f(self, xs):
        total = 0
        for x in xs:
            total += x if self.training else -x
            k = 0
            while k < (2 if self.training else 3):
                k += 1
                total += k if not self.training else 0
        return total

    # 4, not 3: up to 3.13 the compiler emits a `while` test twice (before the loop
    # and at the bottom of its body), so its conditional expression is two sites;
    # 3.14 emits it once
    assert_same(f, [1, 2, 3], sites=4 if sys.version_info < (3, 14) else 3)


def test_lambda():
    lam = lambda self, a, b: a if self.training else b
    assert_same(lam, 1, 2)


def test_exec_code_without_source_file():
    src = (
        "def method(self, x):\n"
        "    y = x + 1\n"
        "    return (y if self.training\n"
        "            else y.missing)\n"
    )
    ns = {}
    exec(compile(src, "<nnscaler-generated>", "exec"), ns)
    new, n_sites = rewritten(ns["method"])
    assert n_sites == 1
    with pytest.raises(AttributeError) as info:
        new(Mod(True), 1)
    frame = traceback.extract_tb(info.value.__traceback__)[-1]
    assert frame.filename == "<nnscaler-generated>"
    assert frame.lineno == 4


def test_self_as_cell_variable():
    def forward(self, x):
        def helper():
            return self.p

        return (x + 1 if self.training else x - 1), helper()

    new = assert_same(forward, 10)
    ops = {ins.opname for ins in dis.get_instructions(new)}
    assert "LOAD_DEREF" in ops


def test_self_as_free_variable():
    def forward(self, x):
        def helper():
            return x + 1 if self.training else x - 1

        return helper

    inner_code = next(c for c in forward.__code__.co_consts if isinstance(c, types.CodeType))
    new_inner, n_sites = rewrite(inner_code)
    assert n_sites == 1
    for training in (True, False):
        helper = forward(Mod(training), 5)
        new_helper = types.FunctionType(new_inner, helper.__globals__, "helper", None,
                                        helper.__closure__)
        assert new_helper() == helper()


@pytest.mark.xfail(sys.version_info >= (3, 12), strict=True,
                   reason="3.12+ load a class body's free `self` with two instructions "
                          "(LOAD_LOCALS; LOAD_FROM_DICT_OR_DEREF); the rewrite matches "
                          "one-instruction loads (class bodies are never intercepted)")
def test_self_in_class_body_classderef():
    def f(self):
        class C:
            v = 1 if self.training else 2
        return C.v

    body = next(c for c in nested_codes(f.__code__) if c.co_name == "C")
    new_body, n_sites = rewrite(body)
    assert n_sites == 1
    assert "LOAD_CLASSDEREF" in {ins.opname for ins in dis.get_instructions(new_body)}
    consts = tuple(new_body if c is body else c for c in f.__code__.co_consts)
    g2 = types.FunctionType(f.__code__.replace(co_consts=consts), f.__globals__)
    assert both_modes(g2) == both_modes(f) == (1, 2)


def test_self_not_a_local_is_left_alone():
    src = "x = 1 if self.training else 2\n"
    code = compile(src, "<module>", "exec")
    assert rewrite(code) == (code, 0)

    def f(other):
        return 1 if other.training else 2

    assert_untouched(f)


def test_keyword_argument():
    def f(self, x):
        return g(x, dropout_p=self.p if self.training else 0, is_causal=True)

    new = assert_same(f, 7)
    assert both_modes(new, 7) == ((7, 0.5, True), (7, 0, True))


def test_return_position_and_yield():
    def f(self, a, b):
        return a if self.training else b

    def gen(self, a, b):
        yield a if self.training else b
        yield b if not self.training else a

    assert_same(f, 1, 2)
    new, n_sites = rewritten(gen)
    assert n_sites == 2
    for training in (True, False):
        assert list(new(Mod(training), 1, 2)) == list(gen(Mod(training), 1, 2))


def test_async_function():
    import asyncio

    async def f(self, a):
        return a if self.training else -a

    new, n_sites = rewritten(f)
    assert n_sites == 1
    for training in (True, False):
        assert asyncio.run(new(Mod(training), 3)) == asyncio.run(f(Mod(training), 3))


def test_many_sites_and_extended_args():
    # > 256 locals and constants push opargs past one byte: EXTENDED_ARG everywhere,
    # and long jumps once the branches grow.
    names = [f"v{i}" for i in range(300)]
    body = "".join(f"    {n} = {i}.5\n" for i, n in enumerate(names))
    long_branch = " + ".join(names[:200])
    body += f"    a = ({long_branch}) if self.training else ({long_branch} - 1)\n"
    body += "".join(f"    {n} = {n} if self.training else -{n}\n" for n in names[250:])
    body += f"    return a, {', '.join(names[250:])}\n"
    ns = {}
    exec(f"def method(self):\n{body}", ns)
    assert_same(ns["method"], sites=51)


def test_jump_offsets_crossing_one_byte():
    # Loops whose backward jump is just under 256 code units before the rewrite and
    # over it after (each site grows by 7 units), and forward jumps over sites:
    # the assembler must grow EXTENDED_ARG prefixes until offsets settle.
    grew = longer = 0
    for filler in range(20, 50):
        body = "".join(f"        t = t + a{j % 3}\n" for j in range(filler))
        src = (
            "def method(self, a0, a1, a2):\n"
            "    t = 0\n"
            "    for i in range(3):\n"
            "        if a0 > 100:\n"
            "            continue\n"
            f"{body}"
            "        t += a0 if self.training else a1\n"
            "        t += (a1 if not self.training else a2) + (a2 if self.training else 0)\n"
            "    return t\n"
        )
        ns = {}
        exec(src, ns)
        fn = ns["method"]
        new = assert_same(fn, 1, 2, 3, sites=3)
        extended = [sum(1 for i in dis.get_instructions(f) if i.opname == "EXTENDED_ARG")
                    for f in (fn, new)]
        grew += extended[1] > extended[0]
        longer += len(new.__code__.co_code) > len(fn.__code__.co_code)
        assert stack_depth(new.__code__) == new.__code__.co_stacksize
    # 3.11/3.12 sites are longer than the code they replace; 3.13+ sites are shorter
    # (TO_BOOL and the jump's cache go), and then no prefix has to grow
    assert grew > 0 or longer == 0


# ---------------------------------------------------------------- the code object

def test_rewrite_twice_is_idempotent():
    def f(self, a, b):
        return (a if self.training else b) if not self.training else (b if self.training else a)

    once, n1 = rewrite(f.__code__)
    twice, n2 = rewrite(once)
    assert n1 == 3 and n2 == 0 and twice is once


def test_dis_shows_ifexpr_call():
    def f(self, a, b):
        return a if self.training else b

    new, _ = rewritten(f)
    out = io.StringIO()
    dis.dis(new, file=out)
    text = out.getvalue()
    assert "ifexpr" in text and all(op in text for op in CALL_OPS)
    ops = [(ins.opname, ins.arg) for ins in dis.get_instructions(new)
           if ins.opname != "RESUME"]
    # the branches' loads are whatever the compiler chose for them
    branch_loads = [op for op, _ in ops[4:6]]
    assert set(branch_loads) <= {"LOAD_FAST", "LOAD_FAST_BORROW"}
    assert [op for op, _ in ops] == (CALL_PREFIX + [FAST_LOAD, "LOAD_ATTR"] + branch_loads
                                     + CALL_OPS + ["RETURN_VALUE"])
    assert ops[6:6 + len(CALL_OPS)] == [(op, 3) for op in CALL_OPS]


def test_other_fields_unchanged():
    def f(self, a, *args, k=1, **kw):
        def inner():
            return self, a
        return a if self.training else k

    code = f.__code__
    new, n_sites = rewrite(code)
    assert n_sites == 1
    for field in ("co_argcount", "co_posonlyargcount", "co_kwonlyargcount", "co_nlocals",
                  "co_flags", "co_varnames", "co_cellvars", "co_freevars", "co_names",
                  "co_name", "co_qualname", "co_filename", "co_firstlineno"):
        assert getattr(new, field) == getattr(code, field), field
    assert new.co_consts[:-1] == code.co_consts and new.co_consts[-1] is ifexpr


def test_stacksize_sufficient_and_exact():
    def f(self, a, b):
        return [a, b, (a, b, (a if self.training else (b if self.training else
                                                        (a if self.training else b))))]

    new = assert_same(f, 1, 2, sites=3)
    # three nested calls, each holding NULL, ifexpr, cond and a value under the next:
    # list items (2) + tuple items (2) + 3 * 4 + the innermost false value
    assert new.__code__.co_stacksize == 2 + 2 + 3 * 4 + 1
    assert new.__code__.co_stacksize > f.__code__.co_stacksize


def _untouched_positions(code, new_code):
    """Positions of the original's instructions, minus the two jumps a site drops,
    beside the rewritten code's, minus what the rewrite inserted."""
    old = [(i.opname, i.argrepr, i.positions) for i in dis.get_instructions(code)
           if i.opname not in DROPPED]
    new = [(i.opname, i.argrepr, i.positions) for i in dis.get_instructions(new_code)
           if i.opname not in INSERTED and i.argval is not ifexpr]
    return old, new


def test_positions_of_untouched_instructions():
    def f(self, x,
          y):
        a = (x.p
             if self.training
             else y.q)
        b = (x.q +
             y.p if not
             self.training else 0)
        return a, b

    new, n_sites = rewritten(f)
    assert n_sites == 2
    old_pos, new_pos = _untouched_positions(f.__code__, new.__code__)
    assert old_pos == new_pos
    # inserted instructions take the condition's / the condition jump's location
    orig = list(dis.get_instructions(f))
    cond_loads = [i.positions for i in orig if i.opname == FAST_LOAD and i.argval == "self"]
    test_jumps = [i.positions for i in orig if i.opname in COND_JUMPS]
    ins = list(dis.get_instructions(new))
    assert [i.positions for i in ins if i.opname == "PUSH_NULL"] == cond_loads
    assert [i.positions for i in ins if i.opname == CALL_OPS[0]] == test_jumps
    # co_lines: same lines, in the same order once consecutive repeats are folded
    def lines(code):
        out = []
        for _, _, line in code.co_lines():
            if not out or out[-1] != line:
                out.append(line)
        return out
    if sys.version_info < (3, 12):
        assert lines(new.__code__) == lines(f.__code__)
    else:
        # 3.12+ lose the jump closing the first branch, which carried the line the
        # join is on: the call (on the condition's line) may add a line event
        # before it; the original sequence stays in order within the new one
        it = iter(lines(new.__code__))
        assert all(line in it for line in lines(f.__code__))
    assert both_modes(new, Obj(), Obj()) == both_modes(f, Obj(), Obj())


def test_traceback_names_user_line():
    def f(self, x):
        y = 1
        return (y if self.training
                else x.missing_attribute)

    new, _ = rewritten(f)
    first_line = f.__code__.co_firstlineno
    with pytest.raises(AttributeError) as info:
        new(Mod(True), Obj())
    frame = traceback.extract_tb(info.value.__traceback__)[-1]
    assert frame.filename == __file__
    assert frame.lineno == first_line + 3
    assert frame.name == "f"
    # the same frame summary, columns included, as the original gives in eval mode
    with pytest.raises(AttributeError) as orig_info:
        f(Mod(False), Obj())
    orig_frame = traceback.extract_tb(orig_info.value.__traceback__)[-1]
    assert (frame.lineno, frame.end_lineno, frame.colno, frame.end_colno) == \
        (orig_frame.lineno, orig_frame.end_lineno, orig_frame.colno, orig_frame.end_colno)


def test_line_events_under_settrace():
    def f(self, a):
        b = a + 1
        c = (a if self.training
             else b)
        return c

    new, _ = rewritten(f)

    def lines_of(fn):
        seen = []

        def tracer(frame, event, arg):
            if frame.f_code is fn.__code__ and event == "line":
                seen.append(frame.f_lineno - fn.__code__.co_firstlineno)
            return tracer

        sys.settrace(tracer)
        try:
            fn(Mod(True), 1)
        finally:
            sys.settrace(None)
        return seen

    # the rewrite runs both branches, so line 3 shows up in train mode too
    assert lines_of(new) == [1, 2, 3, 2, 4]
    assert lines_of(f) == [1, 2, 4]


# ---------------------------------------------------------------- errors

def test_bad_arguments():
    with pytest.raises(TypeError):
        _C.rewrite_code(lambda: 0, ifexpr)
    with pytest.raises(TypeError, match="callable"):
        _C.rewrite_code(test_bad_arguments.__code__, 42)


def test_corrupt_tables_raise_naming_the_code():
    def f(self, a, b):
        return a if self.training else b

    bad = f.__code__.replace(co_exceptiontable=b"\x81")
    with pytest.raises(ValueError, match=r"co_exceptiontable .*in .*f at .*test_rewrite\.py:\d+"):
        rewrite(bad)
    bad = f.__code__.replace(co_linetable=b"\x01\x02")
    with pytest.raises(ValueError, match=r"co_linetable"):
        rewrite(bad)


def test_jump_into_extended_arg_is_refused():
    def f(self, a, b):
        return a if self.training else b

    code = bytearray(f.__code__.co_code)
    ops = dis.opmap
    # turn the final RETURN_VALUE into EXTENDED_ARG with nothing after it
    assert code[-2] == ops["RETURN_VALUE"]
    code[-2] = ops["EXTENDED_ARG"]
    with pytest.raises(ValueError, match="EXTENDED_ARG"):
        rewrite(f.__code__.replace(co_code=bytes(code)))


# ---------------------------------------------------------------- the seeds' module

def test_scaled_dot_product_attention_module():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class SelfAttention(nn.Module):
        def __init__(self, dropout=0.3, is_causal=True):
            super().__init__()
            self.dropout = dropout
            self.is_causal = is_causal

        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None,
                dropout_p=self.dropout if self.training else 0,
                is_causal=self.is_causal
            )

    new_forward, n_sites = rewritten(SelfAttention.forward)
    assert n_sites == 1
    module = SelfAttention()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=gen) for _ in range(3))
    for train in (False, True):
        module.train(train)
        torch.manual_seed(1234)
        expected = module(q, k, v)
        torch.manual_seed(1234)
        got = new_forward(module, q, k, v)
        assert torch.equal(expected, got)
    # in train mode dropout really ran (the two modes differ)
    module.eval()
    assert not torch.equal(new_forward(module, q, k, v), got)
