/* frame_calls.c - running a frame's code: on CPython's evaluator, rewritten, or as
 * a call with its argument slots (frame_calls.h).
 *
 * Reentrancy: every function that runs the frame or a callee runs arbitrary Python;
 * nothing here keeps state across those calls.
 */
#include "frame_calls.h"
#include "nns_globals.h"

Py_ssize_t
code_arg_slots(PyCodeObject *code)
{
    Py_ssize_t n = code->co_argcount + code->co_kwonlyargcount;
    if (code->co_flags & CO_VARARGS) {
        n++;
    }
    if (code->co_flags & CO_VARKEYWORDS) {
        n++;
    }
    return n;
}

PyObject *
call_with_slots(PyObject *callable, PyCodeObject *code, PyObject *const *slots)
{
    PyObject *result = NULL;
    PyObject *kwnames = NULL;            /* owned */
    PyObject *small[16];
    PyObject **args = small;
    Py_ssize_t npos = code->co_argcount;
    Py_ssize_t nkwonly = code->co_kwonlyargcount;
    Py_ssize_t index = npos + nkwonly;
    PyObject *varargs = (code->co_flags & CO_VARARGS) ? slots[index++] : NULL;
    PyObject *varkw = (code->co_flags & CO_VARKEYWORDS) ? slots[index] : NULL;
    Py_ssize_t nvar = varargs ? PyTuple_GET_SIZE(varargs) : 0;
    Py_ssize_t nvarkw = varkw ? PyDict_GET_SIZE(varkw) : 0;
    Py_ssize_t total = npos + nvar + nkwonly + nvarkw;

    if (total > (Py_ssize_t)(sizeof(small) / sizeof(small[0]))) {
        args = PyMem_Malloc(sizeof(PyObject *) * (size_t)total);
        if (args == NULL) {
            PyErr_NoMemory();
            goto error;
        }
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < npos; i++) {
        args[n++] = slots[i];
    }
    for (Py_ssize_t i = 0; i < nvar; i++) {
        args[n++] = PyTuple_GET_ITEM(varargs, i);
    }
    Py_ssize_t npositional = n;
    if (nkwonly + nvarkw > 0) {
        kwnames = PyTuple_New(nkwonly + nvarkw);
        if (kwnames == NULL) {
            goto error;
        }
        /* co_localsplusnames starts with the parameters in order. */
        PyObject *names = code->co_localsplusnames;
        for (Py_ssize_t i = 0; i < nkwonly; i++) {
            PyTuple_SET_ITEM(kwnames, i, Py_NewRef(PyTuple_GET_ITEM(names, npos + i)));
            args[n++] = slots[npos + i];
        }
        Py_ssize_t pos = 0, k = nkwonly;
        PyObject *key, *value;
        while (varkw != NULL && PyDict_Next(varkw, &pos, &key, &value)) {
            PyTuple_SET_ITEM(kwnames, k++, Py_NewRef(key));
            args[n++] = value;
        }
    }
    result = PyObject_Vectorcall(callable, args, (size_t)npositional, kwnames);
error:
    Py_XDECREF(kwnames);
    if (args != small) {
        PyMem_Free(args);
    }
    return result;
}

PyObject *
function_with_code(PyObject *func, PyObject *code)
{
    PyObject *closure = PyFunction_GET_CLOSURE(func);
    PyObject *fn = PyFunction_New(code, PyFunction_GET_GLOBALS(func));
    if (fn == NULL) {
        return NULL;
    }
    if (closure != NULL && PyFunction_SetClosure(fn, closure) < 0) {
        Py_DECREF(fn);
        return NULL;
    }
    return fn;
}

/* Runs the rewritten code in place of the frame's own code.  The new function is
 * made per call on purpose: caching it in the CodeState would hold the function's
 * globals, which usually lead back to this code object: a cycle the GC cannot see. */
PyObject *
frame_run_rewritten(PyThreadState *ts, NnsFrame *frame, CodeState *cs, int throw_flag)
{
    return frame_run_code(ts, frame, cs->rewritten, throw_flag);
}

PyObject *
frame_run_code(PyThreadState *ts, NnsFrame *frame, PyObject *code, int throw_flag)
{
    PyObject *func = nns_frame_function(frame);
    if (func == NULL || !PyFunction_Check(func)) {
        return frame_run_default(ts, frame, throw_flag);
    }
    PyObject *fn = function_with_code(func, code);
    if (fn == NULL) {
        if (nns_report_internal_error("running rewritten code") < 0) {
            return NULL;
        }
        return frame_run_default(ts, frame, throw_flag);
    }
    PyObject **slots = nns_frame_localsplus(frame);
    if (slots == NULL) {
        Py_DECREF(fn);
        if (nns_report_internal_error("running rewritten code") < 0) {
            return NULL;
        }
        return frame_run_default(ts, frame, throw_flag);
    }
    PyObject *result = call_with_slots(fn, nns_frame_code(frame), slots);
    Py_DECREF(fn);
    return result;
}

PyObject *
frame_run_eagerly(PyThreadState *ts, NnsFrame *frame, CodeState *cs)
{
    if (cs->rewritten != NULL) {
        return frame_run_rewritten(ts, frame, cs, 0);
    }
    return frame_run_default(ts, frame, 0);
}
