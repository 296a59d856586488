"""What differs between CPython versions in the bytecode the control-flow analysis reads
and the code it writes: the one place that knows (3.11 to 3.14).

Nothing else in `nnscaler_eval.bytecode` tests `sys.version_info` or names an opcode
that exists in some versions only; it asks `OPS` (the running interpreter's table) or
calls the emitters below.  Opcode numbers come from `dis.opmap`; the shapes come from
CPython's compiler, each cited where it changed:

- 3.11 (bpo-46841, gh-93143): relative jumps in two directions,
  `POP_JUMP_FORWARD_IF_FALSE` / `POP_JUMP_BACKWARD_IF_TRUE` ...; calls are
  `[PRECALL n] CALL n` after `PUSH_NULL, callable` (the NULL below the callable),
  keyword names set by `KW_NAMES` just before; `LOAD_METHOD` loads a method;
  `bool()` of a jump's operand is taken by the jump itself.
- 3.12 (gh-102859, gh-105481): `POP_JUMP_IF_FALSE` / `_TRUE` forward only (loops close
  with `JUMP_BACKWARD`); no `PRECALL`; `LOAD_ATTR` loads a method when `oparg & 1`;
  `RETURN_CONST`; `LOAD_FAST_CHECK` for locals that may be unbound and
  `LOAD_FAST_AND_CLEAR` (PEP 709: comprehensions inlined, their variable saved and
  restored around them); `END_FOR` after a loop; small exit blocks copied into the
  branches that jump to them (Python/flowgraph.c, inline_small_or_no_lineno_blocks),
  so an `if` whose bodies end in the same short `return` has no join.
- 3.13 (gh-106008, gh-107679): `TO_BOOL` before a conditional jump (or `COMPARE_OP`
  with `oparg & 16`, "coerce the result to bool"): `bool()` is taken there, not by the
  jump; the NULL goes *above* the callable (`callable, NULL, args`); `CALL_KW` with
  the names on top replaces `KW_NAMES`; superinstructions `LOAD_FAST_LOAD_FAST`,
  `STORE_FAST_LOAD_FAST`, `STORE_FAST_STORE_FAST` (two locals in `oparg >> 4` and
  `oparg & 15`); `LOAD_CLOSURE` became `LOAD_FAST` of the cell's slot.
- 3.14 (gh-122548, gh-130704, gh-131198): `NOT_TAKEN` after a conditional jump on the
  fall-through side; `LOAD_FAST_BORROW` (and `..._BORROW_LOAD_FAST_BORROW`), a load
  whose reference the compiler proved safe to borrow; `RETURN_CONST` removed;
  `LOAD_SMALL_INT`; `POP_ITER` closes a `for` loop; `with` calls `__enter__` through
  `LOAD_SPECIAL`; `CALL_FUNCTION_EX` always has a kwargs slot (NULL when absent).
"""

from __future__ import annotations

import dis
import sys
from dataclasses import dataclass
from typing import Optional

PY = sys.version_info[:2]
if not (3, 11) <= PY <= (3, 14):   # the C layer refuses other versions too (csrc/compat.h)
    raise ImportError(f"nnscaler_eval.bytecode: CPython {PY[0]}.{PY[1]} is not audited")


def _op(name: str) -> int:
    """The opcode of `name`, or -1 where this version has none."""
    return dis.opmap.get(name, -1)


def _ops(*names: str) -> frozenset[int]:
    return frozenset(dis.opmap[n] for n in names if n in dis.opmap)


@dataclass(frozen=True)
class Opcodes:
    """The running interpreter's opcodes, grouped by what the analysis needs."""

    # -- jumps ---------------------------------------------------------------------
    # conditional jumps that pop their operand and take bool() of it
    bool_jumps_if_true: frozenset[int]
    bool_jumps_if_false: frozenset[int]
    # jumps that always jump
    unconditional_jumps: frozenset[int]
    # control never falls through these (return, raise, re-raise)
    exits: frozenset[int]
    returns: frozenset[int]
    # -- where bool() is taken (3.13+: before the jump) ---------------------------------
    to_bool: int                  # -1 before 3.13
    compare_op: int
    compare_bool_flag: int        # COMPARE_OP's "result to bool" bit (3.13+), else 0
    not_taken: int                # 3.14's fall-through marker, else -1
    # -- locals ---------------------------------------------------------------------------
    load_fast: int
    load_fast_check: int          # -1 on 3.11 (its LOAD_FAST checks)
    load_fast_borrow: int         # 3.14
    load_fast_and_clear: int      # 3.12+: a comprehension saves a variable (may be unbound)
    store_fast: int
    delete_fast: int
    # plain loads of one local that the analysis treats as LOAD_FAST
    local_loads: frozenset[int]
    # (superinstruction, first, second): split into two single instructions
    pairs: tuple[tuple[int, int, int], ...]
    # cells and free variables
    cell_ops: frozenset[int]
    store_deref: int
    delete_deref: int
    # -- calls -------------------------------------------------------------------------
    push_null: int
    precall: int                  # 3.11 only
    call: int
    call_kw: int                  # 3.13+
    kw_names: int                 # 3.11, 3.12
    call_function_ex: int
    call_intrinsic_1: int
    null_below_callable: bool     # [NULL, callable, args] (3.11, 3.12) or [callable, NULL, args]
    ex_kwargs_always: bool        # 3.14: CALL_FUNCTION_EX has its kwargs slot always
    load_method: int              # 3.11
    load_attr: int
    load_attr_method_bit: int     # 3.12+: LOAD_ATTR loads a method when oparg & 1
    load_super_attr: int
    load_special: int             # 3.14
    load_global: int
    # -- stores and other effects the checked code looks at ----------------------------------
    store_attr: int
    delete_attr: int
    store_subscr: int
    delete_subscr: int
    store_slice: int              # 3.12+
    binary_op: int
    inplace_binary_ops: frozenset[int]   # BINARY_OP opargs of `x op= y`
    iterating: frozenset[int]     # GET_ITER, UNPACK_*, LIST_EXTEND, SET_UPDATE...
    fresh_builders: frozenset[int]   # BUILD_LIST, BUILD_MAP, BUILD_SET...
    before_with: int              # 3.11-3.13
    refused_in_checked: frozenset[int]   # never allowed in a checked branch
    # -- misc ---------------------------------------------------------------------------------
    resume: int
    load_const: int
    return_value: int
    return_const: int             # 3.12, 3.13
    build_tuple: int
    unpack_sequence: int
    swap: int
    copy: int
    pop_top: int
    is_op: int
    pop_jump_if_false: int        # the forward form (3.11: POP_JUMP_FORWARD_IF_FALSE)
    jump_forward: int
    nop: int
    yields: frozenset[int]


def _inplace_opargs() -> frozenset[int]:
    return frozenset(i for i, (name, _) in enumerate(dis._nb_ops)  # type: ignore[attr-defined]
                     if name.startswith("NB_INPLACE_"))


def _table() -> Opcodes:
    return Opcodes(
        bool_jumps_if_true=_ops("POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_TRUE",
                                "POP_JUMP_IF_TRUE"),
        bool_jumps_if_false=_ops("POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_FALSE",
                                 "POP_JUMP_IF_FALSE"),
        unconditional_jumps=_ops("JUMP_FORWARD", "JUMP_BACKWARD",
                                 "JUMP_BACKWARD_NO_INTERRUPT"),
        exits=_ops("RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE"),
        returns=_ops("RETURN_VALUE", "RETURN_CONST"),
        to_bool=_op("TO_BOOL"),
        compare_op=_op("COMPARE_OP"),
        compare_bool_flag=16 if PY >= (3, 13) else 0,
        not_taken=_op("NOT_TAKEN"),
        load_fast=_op("LOAD_FAST"),
        load_fast_check=_op("LOAD_FAST_CHECK"),
        load_fast_borrow=_op("LOAD_FAST_BORROW"),
        load_fast_and_clear=_op("LOAD_FAST_AND_CLEAR"),
        store_fast=_op("STORE_FAST"),
        delete_fast=_op("DELETE_FAST"),
        local_loads=_ops("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"),
        pairs=tuple((dis.opmap[pair], dis.opmap[first], dis.opmap[second])
                    for pair, first, second in (
                        ("LOAD_FAST_LOAD_FAST", "LOAD_FAST", "LOAD_FAST"),
                        ("LOAD_FAST_BORROW_LOAD_FAST_BORROW", "LOAD_FAST", "LOAD_FAST"),
                        ("STORE_FAST_LOAD_FAST", "STORE_FAST", "LOAD_FAST"),
                        ("STORE_FAST_STORE_FAST", "STORE_FAST", "STORE_FAST"))
                    if pair in dis.opmap),
        cell_ops=_ops("LOAD_DEREF", "STORE_DEREF", "DELETE_DEREF", "LOAD_CLOSURE",
                      "LOAD_CLASSDEREF", "MAKE_CELL", "COPY_FREE_VARS",
                      "LOAD_FROM_DICT_OR_DEREF"),
        store_deref=_op("STORE_DEREF"),
        delete_deref=_op("DELETE_DEREF"),
        push_null=_op("PUSH_NULL"),
        precall=_op("PRECALL"),
        call=_op("CALL"),
        call_kw=_op("CALL_KW"),
        kw_names=_op("KW_NAMES"),
        call_function_ex=_op("CALL_FUNCTION_EX"),
        call_intrinsic_1=_op("CALL_INTRINSIC_1"),
        null_below_callable=PY < (3, 13),
        ex_kwargs_always=PY >= (3, 14),
        load_method=_op("LOAD_METHOD") if PY < (3, 12) else -1,
        load_attr=_op("LOAD_ATTR"),
        load_attr_method_bit=1 if PY >= (3, 12) else 0,
        load_super_attr=_op("LOAD_SUPER_ATTR"),
        load_special=_op("LOAD_SPECIAL"),
        load_global=_op("LOAD_GLOBAL"),
        store_attr=_op("STORE_ATTR"),
        delete_attr=_op("DELETE_ATTR"),
        store_subscr=_op("STORE_SUBSCR"),
        delete_subscr=_op("DELETE_SUBSCR"),
        store_slice=_op("STORE_SLICE"),
        binary_op=_op("BINARY_OP"),
        inplace_binary_ops=_inplace_opargs(),
        iterating=_ops("GET_ITER", "UNPACK_SEQUENCE", "UNPACK_EX", "LIST_EXTEND",
                       "SET_UPDATE", "GET_YIELD_FROM_ITER"),
        fresh_builders=_ops("BUILD_LIST", "BUILD_MAP", "BUILD_SET", "BUILD_CONST_KEY_MAP"),
        before_with=_op("BEFORE_WITH"),
        refused_in_checked=_ops("STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME", "DELETE_NAME",
                                "IMPORT_NAME", "IMPORT_FROM", "IMPORT_STAR", "PRINT_EXPR",
                                "LOAD_BUILD_CLASS", "SETUP_ANNOTATIONS", "LOAD_SPECIAL",
                                "GET_AWAITABLE", "GET_AITER", "GET_ANEXT", "BEFORE_ASYNC_WITH",
                                "END_ASYNC_FOR", "CALL_INTRINSIC_2"),
        resume=_op("RESUME"),
        load_const=_op("LOAD_CONST"),
        return_value=_op("RETURN_VALUE"),
        return_const=_op("RETURN_CONST"),
        build_tuple=_op("BUILD_TUPLE"),
        unpack_sequence=_op("UNPACK_SEQUENCE"),
        swap=_op("SWAP"),
        copy=_op("COPY"),
        pop_top=_op("POP_TOP"),
        is_op=_op("IS_OP"),
        pop_jump_if_false=_op("POP_JUMP_FORWARD_IF_FALSE") if PY < (3, 12)
        else _op("POP_JUMP_IF_FALSE"),
        jump_forward=_op("JUMP_FORWARD"),
        nop=_op("NOP"),
        yields=_ops("YIELD_VALUE", "SEND", "RETURN_GENERATOR"),
    )


OPS = _table()

# CALL_INTRINSIC_1 opargs that print or import (3.12+, Include/internal/pycore_intrinsics.h)
INTRINSICS_REFUSED = frozenset(
    i for i, name in enumerate(getattr(dis, "_intrinsic_1_descs", ()))
    if name in ("INTRINSIC_PRINT", "INTRINSIC_IMPORT_STAR"))


def stack_effect(opcode: int, oparg: int, jump: Optional[bool]) -> int:
    """CPython's own stack effect (dis.stack_effect): None = the larger of both ways."""
    return dis.stack_effect(opcode, oparg if opcode >= dis.HAVE_ARGUMENT else None,
                            jump=jump)


def bool_is_taken_before_jump() -> bool:
    """3.13+ (gh-106008): `bool()` of an `if`'s test is taken by `TO_BOOL` (or a
    `COMPARE_OP` with its bool flag) just before the jump, not by the jump."""
    return OPS.to_bool >= 0


def while_test_copied() -> bool:
    """3.11-3.13 compile `while test: body` with the test copied after the body (the
    loop jumps back to the body); 3.14's compiler no longer copies it: the body jumps back to the one
    test.  The analysis finds both forms (code_graph.Analysis._find_loops); this says
    which to expect."""
    return PY < (3, 14)


# -- emitters ---------------------------------------------------------------------------
# Each returns a list of (opcode, oparg) pairs; the caller gives them a location and a
# handler.  A "constant" argument is an index into the code's co_consts (the caller
# adds the object there).

def call(argc: int) -> list[tuple[int, int]]:
    """Call the callable under `argc` arguments (pushed after the NULL/callable pair)."""
    if OPS.precall >= 0:     # 3.11: PRECALL, then CALL (gh-91462)
        return [(OPS.precall, argc), (OPS.call, argc)]
    return [(OPS.call, argc)]


def push_callable(const_index: int) -> list[tuple[int, int]]:
    """Push a constant callable and the NULL beside it, in this version's order."""
    if OPS.null_below_callable:
        return [(OPS.push_null, 0), (OPS.load_const, const_index)]
    return [(OPS.load_const, const_index), (OPS.push_null, 0)]


def call_on_top(const_index: int) -> list[tuple[int, int]]:
    """[.., v] -> [.., fn(v)] for the constant callable `fn`."""
    if OPS.null_below_callable:
        # [v] -> [v, NULL] -> [NULL, v] -> [NULL, v, fn] -> [NULL, fn, v]
        return [(OPS.push_null, 0), (OPS.swap, 2), (OPS.load_const, const_index),
                (OPS.swap, 2), *call(1)]
    # [v] -> [v, fn] -> [fn, v] -> [fn, v, NULL] -> [fn, NULL, v]
    return [(OPS.load_const, const_index), (OPS.swap, 2), (OPS.push_null, 0),
            (OPS.swap, 2), *call(1)]


def call_on_copy(const_index: int, depth: int) -> list[tuple[int, int]]:
    """Call the constant `fn` on the value `depth` deep (1 = top) and drop its result;
    the stack is left as it was."""
    return [*push_callable(const_index), (OPS.copy, depth + 2), *call(1), (OPS.pop_top, 0)]


def call_with_constants(const_index: int, arg_indices: list[int]) -> list[tuple[int, int]]:
    """Push `fn(*consts)` for constant `fn` and constant arguments."""
    return [*push_callable(const_index), *[(OPS.load_const, i) for i in arg_indices],
            *call(len(arg_indices))]


def through_trampoline(kind: str, argc: int, const_index: int,
                       names_index: int = -1) -> list[tuple[int, int]]:
    """Replace a call instruction by a call of the constant `trampoline`, which gets the
    original callable and its arguments: `trampoline(callable, args_tuple[, names])`
    for "call" (names: the keyword names, last arguments), "call_kw" (3.13+: the names
    tuple is the last item of the tuple), or `trampoline(callable, args, kwargs_or_None)`
    for "ex" (CALL_FUNCTION_EX; `argc` 1 when a kwargs dict is on the stack).

    The stack holds the callable in this version's slot (method loads were made plain
    attribute loads first, so the NULL slot holds NULL): [NULL, f, args...] on 3.11 and
    3.12, [f, NULL, args...] on 3.13+."""
    t = (OPS.load_const, const_index)
    below = OPS.null_below_callable
    if kind == "call":
        seq = [(OPS.build_tuple, argc)]
        if names_index < 0:
            # [.., f, t] + tr -> swap the trampoline into f's slot, f next to t
            seq += [t, (OPS.swap, 3 if below else 4), (OPS.swap, 2)]
            return seq + call(2)
        # [.., f, t, names, tr]
        seq += [(OPS.load_const, names_index), t, (OPS.swap, 4 if below else 5),
                (OPS.swap, 3), (OPS.swap, 2)]
        return seq + call(3)
    if kind == "call_kw":     # 3.13+: [f, NULL, args..., names]
        return [(OPS.build_tuple, argc + 1), t, (OPS.swap, 4), (OPS.swap, 2), *call(2)]
    if kind == "ex":
        if argc:     # a kwargs dict on top: [.., f, a, k, tr]
            return [t, (OPS.swap, 4 if below else 5), (OPS.swap, 3), (OPS.swap, 2),
                    *call(3)]
        return [t, (OPS.swap, 3 if below else 4), (OPS.swap, 2), *call(2)]
    raise ValueError(kind)
