/* compat_py314.c - CPython 3.14 internals, quarantined.
 *
 * Audited against CPython v3.14.10 (the headers of ../shared/python's 3.14.10 build):
 *   Include/internal/pycore_interpframe_structs.h  (struct _PyInterpreterFrame, moved
 *                          here from pycore_frame.h; enum _frameowner renumbered:
 *                          FRAME_OWNED_BY_INTERPRETER = 3, FRAME_OWNED_BY_CSTACK = 4)
 *   Include/internal/pycore_stackref.h  (_PyStackRef: f_executable, f_funcobj and
 *                          localsplus are tagged; low bit set = reference not counted
 *                          on the object; NULL is the tag alone, not 0)
 *   Include/internal/pycore_ceval.h     (_PyEval_FrameClearAndPop, exported)
 *   Include/cpython/pystate.h           (PyThreadState.tracing)
 *   Include/opcode_ids.h, opcode._inline_cache_entries
 * What changed from 3.13 that this file handles: the tagged frame fields; dict
 * version tags are gone (compat_shared.c watches dicts instead); BINARY_SUBSCR is
 * BINARY_OP [], BEFORE_WITH is LOAD_SPECIAL, RETURN_CONST is gone; NOT_TAKEN after a
 * conditional jump's fall-through; LOAD_FAST_BORROW(_LOAD_FAST_BORROW); END_ASYNC_FOR
 * carries a backward target.
 * Nothing here is copied from CPython; it only reads the 3.14 layouts.
 */
#include "compat.h"

#ifdef NNS_PY314

/* CPython 3.14's internal headers warn under -Wextra (unused parameters `tstate`
 * and `op` in their inline functions): silenced for those headers only. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#define Py_BUILD_CORE 1
#include <internal/pycore_interpframe_structs.h>
#include <internal/pycore_stackref.h>
#include <internal/pycore_ceval.h>
#undef Py_BUILD_CORE
#pragma GCC diagnostic pop
#include <opcode.h>

PyCodeObject *
nns_frame_code(NnsFrame *frame)
{
    /* f_executable is a code object for every frame handed to an evaluator. */
    return (PyCodeObject *)PyStackRef_AsPyObjectBorrow(frame->f_executable);
}

#ifdef Py_STACKREF_DEBUG
#  error "nnscaler-eval: stack references of a Py_STACKREF_DEBUG build are not pointers"
#endif
const size_t nns_frame_code_offset = offsetof(struct _PyInterpreterFrame, f_executable);
const uintptr_t nns_frame_code_tag = Py_TAG_BITS;   /* what PyStackRef_AsPyObjectBorrow clears */

PyObject *
nns_frame_function(NnsFrame *frame)
{
    return PyStackRef_AsPyObjectBorrow(frame->f_funcobj);
}

PyObject **
nns_frame_localsplus(NnsFrame *frame)
{
    NnsFrameRun *run = nns_frame_run_of(frame);
    if (run == NULL) {
        Py_FatalError("nnscaler: argument slots read outside the frame's evaluator bracket");
    }
    if (run->args != NULL) {
        return run->args;
    }
    PyCodeObject *code = nns_frame_code(frame);
    Py_ssize_t n = (Py_ssize_t)code->co_argcount + code->co_kwonlyargcount
                   + ((code->co_flags & CO_VARARGS) != 0)
                   + ((code->co_flags & CO_VARKEYWORDS) != 0);
    PyObject **args = run->args_small;
    if (n > (Py_ssize_t)(sizeof(run->args_small) / sizeof(run->args_small[0]))) {
        args = PyMem_Malloc((size_t)n * sizeof(PyObject *));
        if (args == NULL) {
            /* The callers report it as an internal error and run the frame as it is
             * (compat.h); only this first read in a bracket can fail. */
            PyErr_NoMemory();
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        args[i] = PyStackRef_AsPyObjectBorrow(frame->localsplus[i]);
    }
    run->args = args;
    return args;
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
    /* What _PyEval_EvalFrameDefault does on exit (Python/ceval.c, 3.14). */
    _PyEval_FrameClearAndPop(ts, frame);
}

int
nns_thread_in_trace_callback(PyThreadState *ts)
{
    return ts->tracing > 0;
}

/* opcode._inline_cache_entries, 3.14.10 */
const NnsOpcodes nns_opcodes = {
    .cache_entries = {
        [LOAD_GLOBAL] = 4, [BINARY_OP] = 5, [UNPACK_SEQUENCE] = 1, [COMPARE_OP] = 1,
        [CONTAINS_OP] = 1, [FOR_ITER] = 1, [LOAD_SUPER_ATTR] = 1, [LOAD_ATTR] = 9,
        [STORE_ATTR] = 4, [CALL] = 3, [CALL_KW] = 3, [STORE_SUBSCR] = 1, [SEND] = 1,
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
    .op_load_fast_borrow = LOAD_FAST_BORROW,
    .op_load_fast_load_fast = LOAD_FAST_LOAD_FAST,
    .op_load_fast_borrow_load_fast_borrow = LOAD_FAST_BORROW_LOAD_FAST_BORROW,
    .op_pop_jump_forward_if_false = POP_JUMP_IF_FALSE,
    .op_pop_jump_forward_if_true = POP_JUMP_IF_TRUE,
    .op_to_bool = TO_BOOL,
    .op_not_taken = NOT_TAKEN,
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
    case END_ASYNC_FOR:
        /* Falls through at run time; its backward target is the loop's SEND, which
         * the compiler's flow analysis (and ours) treats as an edge. */
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
    case GET_AWAITABLE: case LOAD_SPECIAL:
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

/* Include/cpython/pystate.h (v3.14.10): py_recursion_remaining counts down from
 * py_recursion_limit, charged by Python frames only (_Py_EnterRecursivePy); C
 * recursion is bounded by a stack-pointer check, which this never touches. */
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

#endif /* NNS_PY314 */
