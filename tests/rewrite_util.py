"""Shared helpers for the bytecode-rewrite tests."""
from __future__ import annotations

import dis
import opcode
import sys
import types
from collections.abc import Callable
from typing import Any

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
# RETURN_CONST: 3.12 and 3.13 only
_NO_FALLTHROUGH = _UNCONDITIONAL | {dis.opmap[name] for name in
                                    ("RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS",
                                     "RERAISE") if name in dis.opmap}
# END_ASYNC_FOR (3.14) carries a backward target, as dis reads it
_BACKWARD = {op for op in dis.hasjrel
             if "BACKWARD" in dis.opname[op] or dis.opname[op] == "END_ASYNC_FOR"}
_JUMPS = set(dis.hasjrel) | set(dis.hasjabs)
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200   # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
# 3.11's RETURN_GENERATOR has a table effect of 0 although the resumed frame finds
# the sent value on the stack; 3.12+ count it (+1)
_GENERATOR_ENTRY_DEPTH = 1 - dis.stack_effect(dis.opmap["RETURN_GENERATOR"])


def cache_units(op: int) -> int:
    """Inline CACHE code units after opcode `op` (a list by opcode on 3.11, a dict by
    name on 3.13+)."""
    caches = opcode._inline_cache_entries
    if isinstance(caches, dict):
        return caches.get(opcode.opname[op], 0)
    return caches[op]


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
        end = i + 2 + 2 * cache_units(op)
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
    start = _GENERATOR_ENTRY_DEPTH if code.co_flags & _GENERATOR_FLAGS else 0
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


# ---------------------------------------------------------------- per-version shapes
# What the rewrite emits for one site, and what it drops, on this interpreter:
#   3.11:  PUSH_NULL; LOAD_CONST ifexpr; <cond>; <a>; <b>; [SWAP 2]; PRECALL 3; CALL 3
#   3.12:  PUSH_NULL; LOAD_CONST ifexpr; <cond>; <a>; <b>; [SWAP 2]; CALL 3
#   3.13+: LOAD_CONST ifexpr; PUSH_NULL; <cond>; <a>; <b>; [SWAP 2]; CALL 3
PY = sys.version_info[:2]
CALL_PREFIX = ["PUSH_NULL", "LOAD_CONST"] if PY < (3, 13) else ["LOAD_CONST", "PUSH_NULL"]
CALL_OPS = ["PRECALL", "CALL"] if PY < (3, 12) else ["CALL"]
# the load of a local the compiler uses for `self` (and a branch's operands) here
FAST_LOAD = "LOAD_FAST_BORROW" if "LOAD_FAST_BORROW" in dis.opmap else "LOAD_FAST"
# the condition's conditional jumps, and what a site drops besides them
COND_JUMPS = ({"POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_FORWARD_IF_TRUE"} if PY < (3, 12)
              else {"POP_JUMP_IF_FALSE", "POP_JUMP_IF_TRUE"})
DROPPED = COND_JUMPS | {"JUMP_FORWARD"} | {name for name in ("TO_BOOL", "NOT_TAKEN")
                                            if name in dis.opmap}
INSERTED = {"PUSH_NULL", "SWAP"} | set(CALL_OPS)
