/* compat_opcodes.c - what the bytecode rewrite knows of each opcode (compat.h,
 * "bytecode tables"), written once for every audited version.
 *
 * The numbers come from the <opcode.h> of the CPython being built against; what
 * differs between versions is selected here by the names of compat_versions.h, one
 * block per difference, each citing the CPython change behind it: the gh issue
 * where "What's New In Python 3.X" (CPython bytecode changes) names one, else the
 * release's file that shows it (Lib/opcode.py; Lib/_opcode_metadata.py from 3.13
 * on), as audited in v3.11.7, v3.12.1, v3.13.15 and v3.14.10.
 * Nothing here reads interpreter internals: opcode numbers, the compiler's public
 * stack-effect table and PyCodeObject's fields.
 */
#include "compat.h"

#include <opcode.h>

/* ---------------------------------------------------------------- the table */

/* Facts of one opcode, for the classification functions of compat.h. */
enum {
    FACT_FORWARD = 1 << 0,        /* a relative jump forward */
    FACT_BACKWARD = 1 << 1,       /* a relative jump backward */
    FACT_UNCONDITIONAL = 1 << 2,  /* the jump is always taken */
    FACT_TERMINATOR = 1 << 3,     /* control never falls through to the next one */
    FACT_CALL = 1 << 4,           /* calls a Python-level callable */
    FACT_STORE = 1 << 5,          /* stores or deletes a name, or has like effects */
};

#define ALWAYS_FORWARD (FACT_FORWARD | FACT_UNCONDITIONAL | FACT_TERMINATOR)
#define ALWAYS_BACKWARD (FACT_BACKWARD | FACT_UNCONDITIONAL | FACT_TERMINATOR)

static const unsigned char facts[256] = {
    /* 3.11 to 3.14 alike */
    [JUMP_FORWARD] = ALWAYS_FORWARD,
    [JUMP_BACKWARD] = ALWAYS_BACKWARD,
    [JUMP_BACKWARD_NO_INTERRUPT] = ALWAYS_BACKWARD,
    [FOR_ITER] = FACT_FORWARD,
    [SEND] = FACT_FORWARD | FACT_STORE,
    [RETURN_VALUE] = FACT_TERMINATOR,
    [RAISE_VARARGS] = FACT_TERMINATOR,
    [RERAISE] = FACT_TERMINATOR,
    [CALL] = FACT_CALL,
    [CALL_FUNCTION_EX] = FACT_CALL,
    [STORE_FAST] = FACT_STORE,
    [STORE_NAME] = FACT_STORE,
    [STORE_GLOBAL] = FACT_STORE,
    [STORE_DEREF] = FACT_STORE,
    [STORE_ATTR] = FACT_STORE,
    [STORE_SUBSCR] = FACT_STORE,
    [DELETE_FAST] = FACT_STORE,
    [DELETE_NAME] = FACT_STORE,
    [DELETE_GLOBAL] = FACT_STORE,
    [DELETE_DEREF] = FACT_STORE,
    [DELETE_ATTR] = FACT_STORE,
    [DELETE_SUBSCR] = FACT_STORE,
    [IMPORT_NAME] = FACT_STORE,
    [YIELD_VALUE] = FACT_STORE,
    [GET_AWAITABLE] = FACT_STORE,
#if NNS_PY_MINOR == 11
    /* Conditional jumps said their direction (POP_JUMP_FORWARD_IF_*,
     * POP_JUMP_BACKWARD_IF_*) until 3.12, whose POP_JUMP_IF_* jump forward only
     * (Lib/opcode.py, v3.11.7 and v3.12.1). */
    [POP_JUMP_FORWARD_IF_FALSE] = FACT_FORWARD,
    [POP_JUMP_FORWARD_IF_TRUE] = FACT_FORWARD,
    [POP_JUMP_FORWARD_IF_NONE] = FACT_FORWARD,
    [POP_JUMP_FORWARD_IF_NOT_NONE] = FACT_FORWARD,
    [POP_JUMP_BACKWARD_IF_FALSE] = FACT_BACKWARD,
    [POP_JUMP_BACKWARD_IF_TRUE] = FACT_BACKWARD,
    [POP_JUMP_BACKWARD_IF_NONE] = FACT_BACKWARD,
    [POP_JUMP_BACKWARD_IF_NOT_NONE] = FACT_BACKWARD,
    /* Removed in 3.12: JUMP_IF_FALSE_OR_POP and JUMP_IF_TRUE_OR_POP (gh-102859),
     * PRECALL (gh-92925); IMPORT_STAR became an intrinsic call (Lib/opcode.py,
     * v3.12.1). */
    [JUMP_IF_FALSE_OR_POP] = FACT_FORWARD,
    [JUMP_IF_TRUE_OR_POP] = FACT_FORWARD,
    [PRECALL] = FACT_CALL,
    [IMPORT_STAR] = FACT_STORE,
    /* IMPORT_FROM and BEFORE_ASYNC_WITH exist in 3.11 too, but its list never
     * counted them as stores; kept so (the lists of 3.12 on do). */
#else
    [POP_JUMP_IF_FALSE] = FACT_FORWARD,
    [POP_JUMP_IF_TRUE] = FACT_FORWARD,
    [POP_JUMP_IF_NONE] = FACT_FORWARD,
    [POP_JUMP_IF_NOT_NONE] = FACT_FORWARD,
    /* STORE_SLICE is new in 3.12 (Lib/opcode.py, v3.12.1). */
    [STORE_SLICE] = FACT_STORE,
    [IMPORT_FROM] = FACT_STORE,   /* a store from 3.12's list on (see above) */
#endif
#if NNS_PY_MINOR <= 13
    /* 3.14 turned BEFORE_WITH and BEFORE_ASYNC_WITH into LOAD_SPECIAL
     * (Lib/_opcode_metadata.py, v3.14.10). */
    [BEFORE_WITH] = FACT_STORE,
#endif
#if NNS_PY_MINOR == 12 || NNS_PY_MINOR == 13
    [BEFORE_ASYNC_WITH] = FACT_STORE,
    /* RETURN_CONST is in 3.12 and 3.13 only (Lib/opcode.py, v3.12.1;
     * Lib/_opcode_metadata.py, v3.13.15 and v3.14.10). */
    [RETURN_CONST] = FACT_TERMINATOR,
#endif
#if NNS_PY_MINOR >= 13
    /* CALL_KW replaced KW_NAMES before CALL, and the compiler fuses a store with a
     * load or a store into one superinstruction (Lib/_opcode_metadata.py,
     * v3.13.15). */
    [CALL_KW] = FACT_CALL,
    [STORE_FAST_LOAD_FAST] = FACT_STORE,
    [STORE_FAST_STORE_FAST] = FACT_STORE,
#endif
#if NNS_PY_MINOR >= 14
    [LOAD_SPECIAL] = FACT_STORE,
    /* 3.14's END_ASYNC_FOR carries a backward target (Lib/_opcode_metadata.py,
     * v3.14.10: in hasjump).  It falls through at run time; its target is the
     * loop's SEND, which the compiler's flow analysis (and ours) treats as an
     * edge. */
    [END_ASYNC_FOR] = FACT_BACKWARD,
#endif
};

/* Inline CACHE code units after each opcode: the release's
 * opcode._inline_cache_entries. */
#if NNS_PY_MINOR == 11
#  define CACHE_ENTRIES                                                                   \
    [BINARY_SUBSCR] = 4, [STORE_SUBSCR] = 1, [UNPACK_SEQUENCE] = 1, [STORE_ATTR] = 4,     \
    [LOAD_ATTR] = 4, [COMPARE_OP] = 2, [LOAD_GLOBAL] = 5, [BINARY_OP] = 1,               \
    [LOAD_METHOD] = 10, [PRECALL] = 1, [CALL] = 4
#elif NNS_PY_MINOR == 12
#  define CACHE_ENTRIES                                                                   \
    [LOAD_GLOBAL] = 4, [BINARY_OP] = 1, [UNPACK_SEQUENCE] = 1, [COMPARE_OP] = 1,         \
    [BINARY_SUBSCR] = 1, [FOR_ITER] = 1, [LOAD_SUPER_ATTR] = 1, [LOAD_ATTR] = 9,         \
    [STORE_ATTR] = 4, [CALL] = 3, [STORE_SUBSCR] = 1, [SEND] = 1
#else
/* 3.13 gave conditional jumps, JUMP_BACKWARD and TO_BOOL caches; 3.14 folded
 * BINARY_SUBSCR into BINARY_OP (whose cache grew to 5) and gave CALL_KW one. */
#  define CACHE_ENTRIES_313_314                                                           \
    [LOAD_GLOBAL] = 4, [UNPACK_SEQUENCE] = 1, [COMPARE_OP] = 1, [CONTAINS_OP] = 1,       \
    [FOR_ITER] = 1, [LOAD_SUPER_ATTR] = 1, [LOAD_ATTR] = 9, [STORE_ATTR] = 4,            \
    [CALL] = 3, [STORE_SUBSCR] = 1, [SEND] = 1, [JUMP_BACKWARD] = 1, [TO_BOOL] = 3,      \
    [POP_JUMP_IF_TRUE] = 1, [POP_JUMP_IF_FALSE] = 1, [POP_JUMP_IF_NONE] = 1,             \
    [POP_JUMP_IF_NOT_NONE] = 1
#  if NNS_PY_MINOR == 13
#    define CACHE_ENTRIES CACHE_ENTRIES_313_314, [BINARY_OP] = 1, [BINARY_SUBSCR] = 1
#  else
#    define CACHE_ENTRIES CACHE_ENTRIES_313_314, [BINARY_OP] = 5, [CALL_KW] = 3
#  endif
#endif

const NnsOpcodes nns_opcodes = {
    .cache_entries = {CACHE_ENTRIES},
    /* 3.11 to 3.14 alike */
    .op_cache = CACHE,
    .op_extended_arg = EXTENDED_ARG,
    .op_nop = NOP,
    .op_load_fast = LOAD_FAST,
    .op_load_deref = LOAD_DEREF,
    .op_load_attr = LOAD_ATTR,
    .op_load_const = LOAD_CONST,
    .op_jump_forward = JUMP_FORWARD,
    .op_jump_backward = JUMP_BACKWARD,
    .op_jump_backward_no_interrupt = JUMP_BACKWARD_NO_INTERRUPT,
    .op_push_null = PUSH_NULL,
    .op_call = CALL,
    .op_call_function_ex = CALL_FUNCTION_EX,
    .op_swap = SWAP,
    .op_store_fast = STORE_FAST,
    .op_copy = COPY,
    .op_pop_top = POP_TOP,
    .have_argument = HAVE_ARGUMENT,
#if NNS_PY_MINOR == 11
    /* Removed in 3.12 (see the table above): LOAD_CLASSDEREF (gh-103764), PRECALL,
     * JUMP_IF_*_OR_POP, the directional conditional jumps. */
    .op_load_classderef = LOAD_CLASSDEREF,
    .op_precall = PRECALL,
    .op_jump_if_true_or_pop = JUMP_IF_TRUE_OR_POP,
    .op_jump_if_false_or_pop = JUMP_IF_FALSE_OR_POP,
    .op_pop_jump_forward_if_false = POP_JUMP_FORWARD_IF_FALSE,
    .op_pop_jump_forward_if_true = POP_JUMP_FORWARD_IF_TRUE,
    .op_load_fast_check = -1,
    .exit_blocks_copied = 0,
    .linetable_merges_runs = 0,
#else
    .op_load_classderef = -1,
    .op_precall = -1,
    .op_jump_if_true_or_pop = -1,
    .op_jump_if_false_or_pop = -1,
    .op_pop_jump_forward_if_false = POP_JUMP_IF_FALSE,
    .op_pop_jump_forward_if_true = POP_JUMP_IF_TRUE,
    /* New in 3.12 (Lib/opcode.py, v3.12.1). */
    .op_load_fast_check = LOAD_FAST_CHECK,
    /* From 3.12 the compiler copies small exit blocks into the branches jumping to
     * them (Python/flowgraph.c, inline_small_or_no_lineno_blocks, v3.12.1) and
     * writes one location entry for a run of instructions with the same location
     * (Python/assemble.c, assemble_location_info, v3.12.1; 3.11.7's compile.c wrote
     * one per instruction). */
    .exit_blocks_copied = 1,
    .linetable_merges_runs = 1,
#endif
#if NNS_PY_MINOR <= 12
    /* 3.13 replaced KW_NAMES with CALL_KW (Lib/_opcode_metadata.py, v3.13.15). */
    .op_kw_names = KW_NAMES,
    /* The NULL goes below the callable (PUSH_NULL, callable, args) until 3.13 puts
     * it above (callable, NULL, args: Doc/library/dis.rst, CALL, v3.13.15, "the
     * callable now always appears at the same position on the stack"). */
    .call_null_below_callable = 1,
    .op_load_fast_load_fast = -1,
    .op_to_bool = -1,
#else
    .op_kw_names = -1,
    .call_null_below_callable = 0,
    /* New in 3.13 (Lib/_opcode_metadata.py, v3.13.15): a superinstruction loading
     * two locals, and TO_BOOL before each conditional jump. */
    .op_load_fast_load_fast = LOAD_FAST_LOAD_FAST,
    .op_to_bool = TO_BOOL,
#endif
#if NNS_PY_MINOR <= 13
    .op_load_fast_borrow = -1,
    .op_load_fast_borrow_load_fast_borrow = -1,
    .op_not_taken = -1,
#else
    /* New in 3.14 (Lib/_opcode_metadata.py, v3.14.10): loads of a borrowed local,
     * and NOT_TAKEN on a conditional jump's fall-through edge. */
    .op_load_fast_borrow = LOAD_FAST_BORROW,
    .op_load_fast_borrow_load_fast_borrow = LOAD_FAST_BORROW_LOAD_FAST_BORROW,
    .op_not_taken = NOT_TAKEN,
#endif
};

/* ------------------------------------------------------- the classification */

int
nns_opcode_jump_kind(int opcode, int *unconditional)
{
    const unsigned f = (opcode >= 0 && opcode < 256) ? facts[opcode] : 0;
    *unconditional = (f & FACT_UNCONDITIONAL) != 0;
    return (f & FACT_FORWARD) ? 1 : (f & FACT_BACKWARD) ? 2 : 0;
}

int
nns_opcode_is_terminator(int opcode)
{
    return opcode >= 0 && opcode < 256 && (facts[opcode] & FACT_TERMINATOR) != 0;
}

int
nns_opcode_stack_effect(int opcode, int oparg, int jump)
{
    return PyCompile_OpcodeStackEffectWithJump(opcode, oparg, jump);
}

int
nns_opcode_is_call(int opcode)
{
    return opcode >= 0 && opcode < 256 && (facts[opcode] & FACT_CALL) != 0;
}

int
nns_opcode_is_store(int opcode)
{
    return opcode >= 0 && opcode < 256 && (facts[opcode] & FACT_STORE) != 0;
}

/* ------------------------------------------------------ code-object details */

PyObject *
nns_code_localsplus_name(PyCodeObject *code, int index)
{
    /* Locals, then cells that are not arguments, then free variables, in one array
     * since 3.11; co_localsplusnames holds their names in that order. */
    PyObject *names = code->co_localsplusnames;
    if (index < 0 || index >= PyTuple_GET_SIZE(names)) {
        return NULL;
    }
    return PyTuple_GET_ITEM(names, index);
}

int
nns_load_attr_name_index(int oparg)
{
#if NNS_PY_MINOR == 11
    return oparg;
#else
    /* 3.12 merged LOAD_METHOD into LOAD_ATTR: bit 0 of its oparg says "push a
     * method and its self" (gh-93429). */
    return oparg >> 1;
#endif
}

int
nns_code_entry_stack_depth(PyCodeObject *code)
{
#if NNS_PY_MINOR <= 12
    /* As the compiler's stack-depth pass starts generator-like code: one value, the
     * one it is resumed with (3.12: unless RETURN_GENERATOR's table effect counts
     * it). */
    if (!(code->co_flags & (CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR))) {
        return 0;
    }
#  if NNS_PY_MINOR == 11
    return 1;
#  else
    return 1 - PyCompile_OpcodeStackEffect(RETURN_GENERATOR, 0);
#  endif
#else
    /* From 3.13 RETURN_GENERATOR's table effect (+1) covers the value a generator is
     * resumed with, popped by the POP_TOP after it (Lib/_opcode_metadata.py,
     * v3.13.15). */
    (void)code;
    return 0;
#endif
}
