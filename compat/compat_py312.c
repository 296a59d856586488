/* compat_py312.c - CPython 3.12 internals, quarantined.
 *
 * Audited against CPython v3.12.1, the interpreter `make test-3.12` builds against
 * and runs the suite on (the machine image's pyenv 3.12.1): its headers hold every
 * field and name read below as listed.  The two functions mirrored from 3.12's
 * Python/ceval.c and Python/pystate.c (static or not exported there) were first
 * written from v3.12.7's sources; the suite runs them on 3.12.1.
 *   Include/internal/pycore_frame.h   (_PyInterpreterFrame: f_code, f_funcobj,
 *                                      prev_instr, stacktop; enum _frameowner with
 *                                      FRAME_OWNED_BY_CSTACK)
 *   Include/cpython/pystate.h         (PyThreadState.tracing, datastack_chunk/top/
 *                                      limit, _PyStackChunk)
 *   Python/ceval.c                    (clear_thread_frame, _PyEvalFrameClearAndPop:
 *                                      static in 3.12, mirrored below)
 *   Python/frame.c                    (_PyFrame_ClearExceptCode)
 *   Python/pystate.c                  (_PyThreadState_PopFrame, not exported)
 *   Lib/opcode.py                     (_cache_format; hasjrel)
 * What changed from 3.11: f_func -> f_funcobj, is_entry gone; the evaluator clears
 * and pops frames (an evaluator that does not run one must do it itself); PRECALL,
 * LOAD_METHOD, POP_JUMP_FORWARD/BACKWARD_* and JUMP_IF_*_OR_POP are gone
 * (POP_JUMP_IF_* are forward jumps); RETURN_CONST, END_FOR, LOAD_FAST_CHECK,
 * LOAD_SUPER_ATTR, INSTRUMENTED_* added; LOAD_CLASSDEREF is gone; LOAD_ATTR's name
 * index is oparg >> 1; cache sizes changed; small exit blocks are copied into the
 * branches jumping to them; location entries cover runs of equal locations.
 */
#include "compat.h"

#ifdef NNS_PY312

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

/* Python/pystate.c, _PyThreadState_PopFrame (v3.12.7; not exported in 3.12): give
 * the frame's space back to the thread's data stack, freeing its chunk when the
 * frame was the first one in it. */
static void
pop_frame(PyThreadState *ts, NnsFrame *frame)
{
    PyObject **base = (PyObject **)frame;
    _PyStackChunk *chunk = ts->datastack_chunk;
    if (base == &chunk->data[0]) {
        _PyStackChunk *previous = chunk->previous;   /* the root chunk is never popped */
        ts->datastack_top = &previous->data[previous->top];
        ts->datastack_chunk = previous;
        ts->datastack_limit = (PyObject **)(((char *)previous) + previous->size);
        PyObjectArenaAllocator arena;
        PyObject_GetArenaAllocator(&arena);
        arena.free(arena.ctx, chunk, chunk->size);
    }
    else {
        ts->datastack_top = base;
    }
}

void
nns_frame_clear_and_pop(PyThreadState *ts, NnsFrame *frame)
{
    /* Python/ceval.c clear_thread_frame + Python/frame.c _PyFrame_ClearExceptCode
     * (v3.12.7), for a frame that never ran: _PyEval_Vector pushed it and handed it
     * to us; it was never the thread's current frame, so no frame object exists for
     * it and it is the top of the data stack. */
    if (frame->owner != FRAME_OWNED_BY_THREAD || frame->frame_obj != NULL) {
        Py_FatalError("nnscaler: a frame that never ran is not a plain thread frame");
    }
    for (int i = 0; i < frame->stacktop; i++) {
        Py_XDECREF(frame->localsplus[i]);
    }
    Py_XDECREF(frame->f_locals);
    Py_DECREF(frame->f_funcobj);
    Py_DECREF(frame->f_code);
    pop_frame(ts, frame);
}

int
nns_thread_in_trace_callback(PyThreadState *ts)
{
    return ts->tracing > 0;
}

/* Lib/opcode.py, _cache_format, v3.12.7 */
const NnsOpcodes nns_opcodes = {
    .cache_entries = {
        [LOAD_GLOBAL] = 4, [BINARY_OP] = 1, [UNPACK_SEQUENCE] = 1, [COMPARE_OP] = 1,
        [BINARY_SUBSCR] = 1, [FOR_ITER] = 1, [LOAD_SUPER_ATTR] = 1, [LOAD_ATTR] = 9,
        [STORE_ATTR] = 4, [CALL] = 3, [STORE_SUBSCR] = 1, [SEND] = 1,
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
    .op_load_fast_load_fast = -1,
    .op_load_fast_borrow_load_fast_borrow = -1,
    .op_pop_jump_forward_if_false = POP_JUMP_IF_FALSE,
    .op_pop_jump_forward_if_true = POP_JUMP_IF_TRUE,
    .op_to_bool = -1,
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
    .op_kw_names = KW_NAMES,
    .op_copy = COPY,
    .op_jump_if_true_or_pop = -1,
    .op_jump_if_false_or_pop = -1,
    .call_null_below_callable = 1,
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
    return opcode == CALL || opcode == CALL_FUNCTION_EX;
}

int
nns_opcode_is_store(int opcode)
{
    switch (opcode) {
    case STORE_FAST: case STORE_NAME: case STORE_GLOBAL: case STORE_DEREF:
    case STORE_ATTR: case STORE_SUBSCR: case STORE_SLICE: case DELETE_FAST:
    case DELETE_NAME: case DELETE_GLOBAL: case DELETE_DEREF: case DELETE_ATTR:
    case DELETE_SUBSCR: case IMPORT_NAME: case IMPORT_FROM: case YIELD_VALUE:
    case SEND: case GET_AWAITABLE: case BEFORE_WITH: case BEFORE_ASYNC_WITH:
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
nns_code_entry_stack_depth(PyCodeObject *code)
{
    /* As the compiler's stack-depth pass starts generator-like code: one value (the
     * one it is resumed with) unless RETURN_GENERATOR's table effect counts it. */
    if (!(code->co_flags & (CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR))) {
        return 0;
    }
    return 1 - PyCompile_OpcodeStackEffect(RETURN_GENERATOR, 0);
}

/* Include/cpython/pystate.h (v3.12.1): py_recursion_remaining counts down from
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

#endif /* NNS_PY312 */
