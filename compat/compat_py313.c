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
