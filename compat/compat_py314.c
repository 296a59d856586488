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
 *   Include/cpython/pystate.h           (PyThreadState.tracing, py_recursion_remaining)
 * What changed from 3.13 that this file handles: the tagged frame fields; dict
 * version tags are gone (compat_shared.c watches dicts instead).  The bytecode's
 * changes are in compat_opcodes.c, written once for every version.
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

void
nns_frame_clear_and_pop(PyThreadState *ts, NnsFrame *frame)
{
    /* What _PyEval_EvalFrameDefault does on exit (Python/ceval.c, 3.14). */
    _PyEval_FrameClearAndPop(ts, frame);
}

#endif /* NNS_PY314 */
