/* compat_py313.c - CPython 3.13 internals, quarantined.
 *
 * Audited against CPython v3.13.15 (the headers of ../shared/python's 3.13.15 build):
 *   Include/internal/pycore_frame.h   (_PyInterpreterFrame: f_executable, f_funcobj,
 *                                      PyObject *localsplus[]; enum _frameowner)
 *   Include/internal/pycore_ceval.h   (_PyEval_FrameClearAndPop, exported since 3.13)
 *   Include/cpython/pystate.h         (PyThreadState.tracing)
 *   Include/opcode_ids.h, Lib/_opcode_metadata.py (opcode numbers; cache sizes as in
 *                                      opcode._inline_cache_entries)
 * What changed from 3.11 that this file handles: f_code -> f_executable, f_func ->
 * f_funcobj; the evaluator clears and pops frames it does not run; PRECALL,
 * LOAD_METHOD, KW_NAMES, POP_JUMP_FORWARD/BACKWARD_* and JUMP_IF_*_OR_POP are gone;
 * TO_BOOL precedes conditional jumps, which gained a cache entry; CALL's stack is
 * callable, NULL, args; LOAD_ATTR's name index is oparg >> 1; two-local
 * superinstructions; RETURN_GENERATOR pushes the value a generator is resumed with.
 * Nothing here is copied from CPython; it only reads the 3.13 layouts.
 */
#include "compat.h"

#ifdef NNS_PY313

#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#include <internal/pycore_ceval.h>
#undef Py_BUILD_CORE
#include <opcode.h>

PyCodeObject *
nns_frame_code(NnsFrame *frame)
{
    /* f_executable is a code object for every frame handed to an evaluator. */
    return (PyCodeObject *)frame->f_executable;
}

const size_t nns_frame_code_offset = offsetof(struct _PyInterpreterFrame, f_executable);
const uintptr_t nns_frame_code_tag = 0;

PyObject *
nns_frame_function(NnsFrame *frame)
{
    return frame->f_funcobj;
}

PyObject **
nns_frame_localsplus(NnsFrame *frame)
{
    return frame->localsplus;
}

int
nns_frame_is_generator(NnsFrame *frame)
{
    return frame->owner == FRAME_OWNED_BY_GENERATOR;
}

PyObject *
nns_eval_frame_default(PyThreadState *ts, NnsFrame *frame, int throw_flag)
{
    nns_frame_run_mark_handed(frame);
    return _PyEval_EvalFrameDefault(ts, frame, throw_flag);
}

void
nns_frame_clear_and_pop(PyThreadState *ts, NnsFrame *frame)
{
    /* What _PyEval_EvalFrameDefault does on exit (Python/ceval.c, 3.13). */
    _PyEval_FrameClearAndPop(ts, frame);
}

int
nns_thread_in_trace_callback(PyThreadState *ts)
{
    return ts->tracing > 0;
}

/* opcode._inline_cache_entries, 3.13.15 */
const NnsOpcodes nns_opcodes = {
    .cache_entries = {
        [LOAD_GLOBAL] = 4, [BINARY_OP] = 1, [UNPACK_SEQUENCE] = 1, [COMPARE_OP] = 1,
        [CONTAINS_OP] = 1, [BINARY_SUBSCR] = 1, [FOR_ITER] = 1, [LOAD_SUPER_ATTR] = 1,
        [LOAD_ATTR] = 9, [STORE_ATTR] = 4, [CALL] = 3, [STORE_SUBSCR] = 1, [SEND] = 1,
        [JUMP_BACKWARD] = 1, [TO_BOOL] = 3, [POP_JUMP_IF_TRUE] = 1,
        [POP_JUMP_IF_FALSE] = 1, [POP_JUMP_IF_NONE] = 1, [POP_JUMP_IF_NOT_NONE] = 1,
    },
    .op_cache = CACHE,
    .op_extended_arg = EXTENDED_ARG,
    .op_nop = NOP,
    .op_load_fast = LOAD_FAST,
    .op_load_deref = LOAD_DEREF,
    .op_load_classderef = -1,
    .op_load_attr = LOAD_ATTR,
    .op_load_const = LOAD_CONST,
    .op_load_fast_check = LOAD_FAST_CHECK,
    .op_load_fast_borrow = -1,
    .op_load_fast_load_fast = LOAD_FAST_LOAD_FAST,
    .op_load_fast_borrow_load_fast_borrow = -1,
    .op_pop_jump_forward_if_false = POP_JUMP_IF_FALSE,
    .op_pop_jump_forward_if_true = POP_JUMP_IF_TRUE,
    .op_to_bool = TO_BOOL,
    .op_not_taken = -1,
    .op_jump_forward = JUMP_FORWARD,
    .op_jump_backward = JUMP_BACKWARD,
    .op_jump_backward_no_interrupt = JUMP_BACKWARD_NO_INTERRUPT,
    .op_push_null = PUSH_NULL,
    .op_precall = -1,
    .op_call = CALL,
    .op_call_function_ex = CALL_FUNCTION_EX,
    .op_swap = SWAP,
    .op_store_fast = STORE_FAST,
    .op_kw_names = -1,
    .op_copy = COPY,
    .op_jump_if_true_or_pop = -1,
    .op_jump_if_false_or_pop = -1,
    .call_null_below_callable = 0,
    .op_pop_top = POP_TOP,
    .exit_blocks_copied = 1,
    .linetable_merges_runs = 1,
    .have_argument = HAVE_ARGUMENT,
};

int
nns_opcode_jump_kind(int opcode, int *unconditional)
{
    *unconditional = 0;
    switch (opcode) {
    case JUMP_FORWARD:
        *unconditional = 1;
        return 1;
    case FOR_ITER:
    case POP_JUMP_IF_FALSE:
    case POP_JUMP_IF_TRUE:
    case POP_JUMP_IF_NONE:
    case POP_JUMP_IF_NOT_NONE:
    case SEND:
        return 1;
    case JUMP_BACKWARD:
    case JUMP_BACKWARD_NO_INTERRUPT:
        *unconditional = 1;
        return 2;
    default:
        return 0;
    }
}

int
nns_opcode_is_terminator(int opcode)
{
    switch (opcode) {
    case RETURN_VALUE:
    case RETURN_CONST:
    case RAISE_VARARGS:
    case RERAISE:
    case JUMP_FORWARD:
    case JUMP_BACKWARD:
    case JUMP_BACKWARD_NO_INTERRUPT:
        return 1;
    default:
        return 0;
    }
}

int
nns_opcode_stack_effect(int opcode, int oparg, int jump)
{
    return PyCompile_OpcodeStackEffectWithJump(opcode, oparg, jump);
}

int
nns_opcode_is_call(int opcode)
{
    return opcode == CALL || opcode == CALL_KW || opcode == CALL_FUNCTION_EX;
}

int
nns_opcode_is_store(int opcode)
{
    switch (opcode) {
    case STORE_FAST: case STORE_FAST_LOAD_FAST: case STORE_FAST_STORE_FAST:
    case STORE_NAME: case STORE_GLOBAL: case STORE_DEREF: case STORE_ATTR:
    case STORE_SUBSCR: case STORE_SLICE: case DELETE_FAST: case DELETE_NAME:
    case DELETE_GLOBAL: case DELETE_DEREF: case DELETE_ATTR: case DELETE_SUBSCR:
    case IMPORT_NAME: case IMPORT_FROM: case YIELD_VALUE: case SEND:
    case GET_AWAITABLE: case BEFORE_WITH: case BEFORE_ASYNC_WITH:
        return 1;
    default:
        return 0;
    }
}

PyObject *
nns_code_localsplus_name(PyCodeObject *code, int index)
{
    PyObject *names = code->co_localsplusnames;
    if (index < 0 || index >= PyTuple_GET_SIZE(names)) {
        return NULL;
    }
    return PyTuple_GET_ITEM(names, index);
}

int
nns_load_attr_name_index(int oparg)
{
    return oparg >> 1;   /* bit 0: push a method and its self */
}

int
nns_code_entry_stack_depth(PyCodeObject *Py_UNUSED(code))
{
    /* RETURN_GENERATOR's table effect (+1) covers the value a generator is resumed
     * with, popped by the POP_TOP after it. */
    return 0;
}

/* Include/cpython/pystate.h (v3.13.15): py_recursion_remaining counts down from
 * py_recursion_limit, charged by Python frames only (_Py_EnterRecursivePy); C calls
 * charge c_recursion_remaining, which this never touches. */
int
nns_recursion_used(PyThreadState *ts)
{
    return ts->py_recursion_limit - ts->py_recursion_remaining;
}

void
nns_recursion_credit(PyThreadState *ts, int units)
{
    ts->py_recursion_remaining += units;
}

const int nns_recursion_builtin_call_units = 0;

#endif /* NNS_PY313 */
