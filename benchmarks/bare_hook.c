/* A bare PEP 523 evaluator for benchmarks/bench_ir.py: it hands every frame to
 * CPython's own evaluator and does nothing else, so that the frame_tax group can tell
 * what any installed evaluator costs a Python call (CPython stops inlining
 * Python-to-Python calls while one is installed) from what ours adds on top.  Built on
 * the fly against the running Python's headers into build/bench_ir/, loaded with
 * ctypes.PyDLL (the GIL is held across the calls). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static _PyFrameEvalFunction previous;
static int installed;

static PyObject *
bare_hook(PyThreadState *ts, struct _PyInterpreterFrame *frame, int throw_flag)
{
    return _PyEval_EvalFrameDefault(ts, frame, throw_flag);
}

/* 0, or -1 when an evaluator other than CPython's is installed (ours left armed). */
int
bare_hook_install(void)
{
    PyInterpreterState *interp = PyInterpreterState_Get();
    _PyFrameEvalFunction current = _PyInterpreterState_GetEvalFrameFunc(interp);
    if (installed || current != _PyEval_EvalFrameDefault) {
        return -1;
    }
    previous = current;
    _PyInterpreterState_SetEvalFrameFunc(interp, bare_hook);
    installed = 1;
    return 0;
}

void
bare_hook_uninstall(void)
{
    if (installed) {
        _PyInterpreterState_SetEvalFrameFunc(PyInterpreterState_Get(), previous);
        installed = 0;
    }
}
