"""Shared helpers for the bytecode-rewrite tests."""
from __future__ import annotations

import dis
import opcode
import types
from collections.abc import Callable
from typing import Any, Tuple

from nnscaler_eval import _C
from nnscaler_eval.runtime import ifexpr


def rewrite(code: types.CodeType) -> tuple[types.CodeType, int]:
    """`_C.rewrite_code` with the runtime's `ifexpr`."""
    return _C.rewrite_code(code, ifexpr)


def rewritten(fn: Callable[..., Any]) -> tuple[Callable[..., Any], int]:
    """A copy of `fn` running its rewritten code, and the number of sites rewritten."""
    code, n_sites = rewrite(fn.__code__)
    new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    return new, n_sites


def ifexpr_calls(code: types.CodeType) -> int:
    """How many `LOAD_CONST ifexpr` instructions `code` holds."""
    return sum(1 for ins in dis.get_instructions(code)
               if ins.opname == "LOAD_CONST" and ins.argval is ifexpr)


def nested_codes(code: types.CodeType):
    """`code` and every code object reachable through its co_consts."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from nested_codes(const)


_UNCONDITIONAL = {dis.opmap[name] for name in
                  ("JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT")}
_NO_FALLTHROUGH = _UNCONDITIONAL | {dis.opmap[name] for name in
                                    ("RETURN_VALUE", "RAISE_VARARGS", "RERAISE")}
_BACKWARD = {op for op in dis.hasjrel if "BACKWARD" in dis.opname[op]}
_JUMPS = set(dis.hasjrel) | set(dis.hasjabs)
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200   # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


def _instructions(code):
    """(start offset incl. EXTENDED_ARG prefixes, opcode offset, opcode, oparg, end
    offset) for each instruction, decoded here rather than by the C layer."""
    raw = code.co_code
    out = []
    i = 0
    while i < len(raw):
        start, ext = i, 0
        while raw[i] == dis.EXTENDED_ARG:
            ext = (ext | raw[i + 1]) << 8
            i += 2
        op, arg = raw[i], raw[i + 1] | ext
        end = i + 2 + 2 * opcode._inline_cache_entries[op]
        out.append((start, i, op, arg, end))
        i = end
    return out


def stack_depth(code: types.CodeType) -> int:
    """The deepest stack `code` can reach, by flow analysis.

    Written independently of the C assembler (its own decoding of co_code,
    `dis.stack_effect`, `dis`'s parse of the exception table) so that the two can
    check each other.  Raises AssertionError on inconsistent depths, a stack
    underflow, or a jump or handler that lands on no instruction.
    """
    instrs = _instructions(code)
    index_of = {start: k for k, (start, *_rest) in enumerate(instrs)}
    handler_at = {}
    for entry in dis.Bytecode(code).exception_entries:
        assert entry.target in index_of, f"handler target {entry.target} is no instruction"
        for offset in range(entry.start, entry.end, 2):
            handler_at[offset] = entry
    depth = [None] * len(instrs)
    start = 1 if code.co_flags & _GENERATOR_FLAGS else 0
    max_depth = start
    work = []

    def reach(k, d):
        nonlocal max_depth
        assert d >= 0, f"stack underflow at offset {instrs[k][1]}"
        max_depth = max(max_depth, d)
        if depth[k] is None:
            depth[k] = d
            work.append(k)
        else:
            assert depth[k] == d, f"depth {depth[k]} and {d} meet at offset {instrs[k][1]}"

    if instrs:
        reach(0, start)
    while work:
        k = work.pop()
        _, offset, op, arg, end = instrs[k]
        d = depth[k]
        entry = handler_at.get(offset)
        if entry is not None:
            reach(index_of[entry.target], entry.depth + int(entry.lasti) + 1)
        oparg = arg if op >= dis.HAVE_ARGUMENT else None
        if op in _JUMPS:
            if op in dis.hasjabs:
                target = 2 * arg
            else:
                target = end - 2 * arg if op in _BACKWARD else end + 2 * arg
            assert target in index_of, f"jump at {offset} to {target}"
            reach(index_of[target], d + dis.stack_effect(op, oparg, jump=True))
        after = d + dis.stack_effect(op, oparg, jump=False)
        max_depth = max(max_depth, after)
        if op not in _NO_FALLTHROUGH:
            reach(k + 1, after)
    return max_depth
