/* compat_py313.c - CPython 3.13 internals, quarantined.
 *
 * Audited against CPython v3.13.15 (the headers of ../shared/python's 3.13.15 build):
 *   Include/internal/pycore_frame.h   (_PyInterpreterFrame: f_executable, f_funcobj,
 *                                      PyObject *localsplus[]; enum _frameowner)
 *   Include/internal/pycore_ceval.h   (_PyEval_FrameClearAndPop, exported since 3.13)
 *   Include/cpython/pystate.h         (PyThreadState.tracing, py_recursion_remaining)
 * What changed from 3.12 that this file handles: f_code -> f_executable; the
 * evaluator's clear-and-pop is exported.  The bytecode's changes are in
 * compat_opcodes.c, written once for every version.
 * Nothing here is copied from CPython; it only reads the 3.13 layouts.
 */
#include "compat.h"

#ifdef NNS_PY313

#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#include <internal/pycore_ceval.h>
#undef Py_BUILD_CORE

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

void
nns_frame_clear_and_pop(PyThreadState *ts, NnsFrame *frame)
{
    /* What _PyEval_EvalFrameDefault does on exit (Python/ceval.c, 3.13). */
    _PyEval_FrameClearAndPop(ts, frame);
}

#endif /* NNS_PY313 */
