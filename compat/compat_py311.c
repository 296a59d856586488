/* compat_py311.c - CPython 3.11 internals, quarantined.
 *
 * Audited against CPython v3.11.7:
 *   Include/internal/pycore_frame.h  (_PyInterpreterFrame, enum _frameowner)
 *   Include/cpython/pystate.h        (PyThreadState.tracing)
 *   Lib/opcode.py                    (_inline_cache_entries, hasjrel)
 * Nothing here is copied from CPython; it only reads the 3.11 layouts.
 */
#include "compat.h"

#ifdef NNS_PY311

#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#include <opcode.h>

PyCodeObject *
nns_frame_code(NnsFrame *frame)
{
    return frame->f_code;
}

const size_t nns_frame_code_offset = offsetof(struct _PyInterpreterFrame, f_code);
const uintptr_t nns_frame_code_tag = 0;

PyObject *
nns_frame_function(NnsFrame *frame)
{
    return (PyObject *)frame->f_func;
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
nns_frame_clear_and_pop(PyThreadState *Py_UNUSED(ts), NnsFrame *Py_UNUSED(frame))
{
    /* 3.11: _PyEval_Vector clears and pops the frame after the evaluator returns,
     * whether or not the evaluator ran it (Python/ceval.c, _PyEval_Vector). */
}

int
nns_thread_in_trace_callback(PyThreadState *ts)
{
    /* tstate->tracing is raised while a trace/profile function runs. */
    return ts->tracing > 0;
}

/* nns_dict_version: inline in compat_objects.h on 3.11. */

uint64_t
nns_dict_clock(void)
{
    return 0;
}

int
nns_dict_watched(PyObject *Py_UNUSED(dict))
{
    return 0;
}

/* Lib/opcode.py, _inline_cache_entries, 3.11 */
const NnsOpcodes nns_opcodes = {
    .cache_entries = {
        [BINARY_SUBSCR] = 4, [STORE_SUBSCR] = 1, [UNPACK_SEQUENCE] = 1,
        [STORE_ATTR] = 4, [LOAD_ATTR] = 4, [COMPARE_OP] = 2, [LOAD_GLOBAL] = 5,
        [BINARY_OP] = 1, [LOAD_METHOD] = 10, [PRECALL] = 1, [CALL] = 4,
    },
    .op_cache = CACHE,
    .op_extended_arg = EXTENDED_ARG,
    .op_nop = NOP,
    .op_load_fast = LOAD_FAST,
    .op_load_deref = LOAD_DEREF,
    .op_load_classderef = LOAD_CLASSDEREF,
    .op_load_attr = LOAD_ATTR,
    .op_load_const = LOAD_CONST,
    .op_load_fast_check = -1,
    .op_load_fast_borrow = -1,
    .op_load_fast_load_fast = -1,
    .op_load_fast_borrow_load_fast_borrow = -1,
    .op_to_bool = -1,
    .op_not_taken = -1,
    .op_pop_jump_forward_if_false = POP_JUMP_FORWARD_IF_FALSE,
    .op_pop_jump_forward_if_true = POP_JUMP_FORWARD_IF_TRUE,
    .op_jump_forward = JUMP_FORWARD,
    .op_jump_backward = JUMP_BACKWARD,
    .op_jump_backward_no_interrupt = JUMP_BACKWARD_NO_INTERRUPT,
    .op_push_null = PUSH_NULL,
    .op_precall = PRECALL,
    .op_call = CALL,
    .op_call_function_ex = CALL_FUNCTION_EX,
    .op_swap = SWAP,
    .op_store_fast = STORE_FAST,
    .op_kw_names = KW_NAMES,
    .op_copy = COPY,
    .op_jump_if_true_or_pop = JUMP_IF_TRUE_OR_POP,
    .op_jump_if_false_or_pop = JUMP_IF_FALSE_OR_POP,
    .call_null_below_callable = 1,
    .op_pop_top = POP_TOP,
    .exit_blocks_copied = 0,
    .linetable_merges_runs = 0,
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
    case JUMP_IF_FALSE_OR_POP:
    case JUMP_IF_TRUE_OR_POP:
    case POP_JUMP_FORWARD_IF_FALSE:
    case POP_JUMP_FORWARD_IF_TRUE:
    case POP_JUMP_FORWARD_IF_NOT_NONE:
    case POP_JUMP_FORWARD_IF_NONE:
    case SEND:
        return 1;
    case JUMP_BACKWARD:
    case JUMP_BACKWARD_NO_INTERRUPT:
        *unconditional = 1;
        return 2;
    case POP_JUMP_BACKWARD_IF_NOT_NONE:
    case POP_JUMP_BACKWARD_IF_NONE:
    case POP_JUMP_BACKWARD_IF_FALSE:
    case POP_JUMP_BACKWARD_IF_TRUE:
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
    return opcode == PRECALL || opcode == CALL || opcode == CALL_FUNCTION_EX;
}

int
nns_opcode_is_store(int opcode)
{
    switch (opcode) {
    case STORE_FAST: case STORE_NAME: case STORE_GLOBAL: case STORE_DEREF:
    case STORE_ATTR: case STORE_SUBSCR: case DELETE_FAST: case DELETE_NAME:
    case DELETE_GLOBAL: case DELETE_DEREF: case DELETE_ATTR: case DELETE_SUBSCR:
    case IMPORT_NAME: case IMPORT_STAR: case YIELD_VALUE: case SEND:
    case GET_AWAITABLE: case BEFORE_WITH:
        return 1;
    default:
        return 0;
    }
}

PyObject *
nns_code_localsplus_name(PyCodeObject *code, int index)
{
    /* 3.11 numbers locals, then cells that are not arguments, then free variables,
     * in one array; co_localsplusnames holds their names in that order. */
    PyObject *names = code->co_localsplusnames;
    if (index < 0 || index >= PyTuple_GET_SIZE(names)) {
        return NULL;
    }
    return PyTuple_GET_ITEM(names, index);
}

int
nns_load_attr_name_index(int oparg)
{
    return oparg;
}

int
nns_code_entry_stack_depth(PyCodeObject *code)
{
    return (code->co_flags & (CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR)) ? 1 : 0;
}

/* Include/cpython/pystate.h (v3.11.7): recursion_remaining counts down from
 * recursion_limit; Python frames (_Py_EnterRecursivePy) and C recursive calls
 * (_Py_EnterRecursiveCallTstate) both charge it. */
int
nns_recursion_used(PyThreadState *ts)
{
    return ts->recursion_limit - ts->recursion_remaining;
}

void
nns_recursion_credit(PyThreadState *ts, int units)
{
    ts->recursion_remaining += units;
}

const int nns_recursion_builtin_call_units = 1;

#endif /* NNS_PY311 */
