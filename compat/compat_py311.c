/* compat_py311.c - CPython 3.11 internals, quarantined.
 *
 * Audited against CPython v3.11.7:
 *   Include/internal/pycore_frame.h  (_PyInterpreterFrame, enum _frameowner)
 *   Include/cpython/pystate.h        (PyThreadState.tracing, recursion_remaining)
 * Its opcodes are in compat_opcodes.c, written once for every version.
 * Nothing here is copied from CPython; it only reads the 3.11 layouts.
 */
#include "compat.h"

#ifdef NNS_PY311

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

void
nns_frame_clear_and_pop(PyThreadState *Py_UNUSED(ts), NnsFrame *Py_UNUSED(frame))
{
    /* 3.11: _PyEval_Vector clears and pops the frame after the evaluator returns,
     * whether or not the evaluator ran it (Python/ceval.c, _PyEval_Vector). */
}

#endif /* NNS_PY311 */
