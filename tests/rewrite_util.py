"""Shared helpers for the bytecode-rewrite tests."""
from __future__ import annotations

import dis
import types
from typing import Any, Callable, Tuple

from nnscaler_eval import _C
from nnscaler_eval.runtime import ifexpr


def rewrite(code: types.CodeType) -> Tuple[types.CodeType, int]:
    """`_C.rewrite_code` with the runtime's `ifexpr`."""
    return _C.rewrite_code(code, ifexpr)


def rewritten(fn: Callable[..., Any]) -> Tuple[Callable[..., Any], int]:
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


_UNCONDITIONAL = {"JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT"}
_NO_FALLTHROUGH = _UNCONDITIONAL | {"RETURN_VALUE", "RAISE_VARARGS", "RERAISE"}
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200   # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


def stack_depth(code: types.CodeType) -> int:
    """The deepest stack `code` can reach, by flow analysis over `dis`'s view of it.

    Written independently of the C assembler (it reads `dis.stack_effect`, the jump
    targets `dis` decodes and `dis`'s parse of the exception table) so that the two
    can check each other.  Raises AssertionError on inconsistent depths, a stack
    underflow or a jump that lands on no instruction.
    """
    instrs = [i for i in dis.get_instructions(code)]
    index_of = {ins.offset: k for k, ins in enumerate(instrs)}
    # a jump may land on the EXTENDED_ARG prefix of its target: both name the same index
    for k, ins in enumerate(instrs):
        if ins.opname == "EXTENDED_ARG" and k + 1 < len(instrs):
            index_of.setdefault(instrs[k + 1].offset, k + 1)
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
        assert d >= 0, f"stack underflow at offset {instrs[k].offset}"
        max_depth = max(max_depth, d)
        if depth[k] is None:
            depth[k] = d
            work.append(k)
        else:
            assert depth[k] == d, f"depth {depth[k]} and {d} meet at offset {instrs[k].offset}"

    if instrs:
        reach(0, start)
    while work:
        k = work.pop()
        ins = instrs[k]
        d = depth[k]
        entry = handler_at.get(ins.offset)
        if entry is not None:
            reach(index_of[entry.target], entry.depth + int(entry.lasti) + 1)
        if ins.opname == "EXTENDED_ARG":
            reach(k + 1, d)
            continue
        arg = ins.arg if ins.opcode >= dis.HAVE_ARGUMENT else None
        if ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs:
            assert ins.argval in index_of, f"jump at {ins.offset} to {ins.argval}"
            reach(index_of[ins.argval], d + dis.stack_effect(ins.opcode, arg, jump=True))
        after = d + dis.stack_effect(ins.opcode, arg, jump=False)
        max_depth = max(max_depth, after)
        if ins.opname not in _NO_FALLTHROUGH:
            reach(k + 1, after)
    return max_depth
