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
 * What changed from 3.11 that this file handles: f_func -> f_funcobj, is_entry
 * gone; the evaluator clears and pops frames (an evaluator that does not run one
 * must do it itself); the recursion counter counts Python frames only.  The
 * bytecode's changes are in compat_opcodes.c, written once for every version.
 */
#include "compat.h"

#ifdef NNS_PY312

#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE

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

#endif /* NNS_PY312 */
