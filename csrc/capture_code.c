/* capture_code.c - code run in place of the user's while a capture records. */
#include "capture_code.h"
#include "nns_globals.h"

_Thread_local int capture_code_mode;
Py_ssize_t capture_code_threads;

static void
set_mode(int mode)
{
    capture_code_threads += (mode != 0) - (capture_code_mode != 0);
    capture_code_mode = mode;
}

PyObject *
capture_code_set_mode(PyObject *Py_UNUSED(module), PyObject *arg)
{
    long mode = PyLong_AsLong(arg);
    if (mode == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (mode < 0 || mode > 2) {
        PyErr_SetString(PyExc_ValueError, "capture_code_mode(mode): 0, 1 or 2");
        return NULL;
    }
    int previous = capture_code_mode;
    set_mode((int)mode);
    return PyLong_FromLong(previous);
}

PyObject *
capture_code_mark(PyObject *Py_UNUSED(module), PyObject *code)
{
    if (!PyCode_Check(code)) {
        PyErr_SetString(PyExc_TypeError, "mark_capture_code(code): expected a code object");
        return NULL;
    }
    if (code_state_mark_skip((PyCodeObject *)code) < 0) {
        return NULL;
    }
    code_state_peek((PyCodeObject *)code)->flags |= CS_CAPTURE_CODE;
    Py_RETURN_NONE;
}

int
capture_code_for(NnsFrame *frame, PyCodeObject *code, CodeState *cs, PyObject **alt)
{
    int checked = capture_code_mode == 2;
    *alt = NULL;
    if (cs->capture_known[checked]) {
        *alt = cs->capture_code[checked];
        return 0;
    }
    if (nns_globals.capture_code == NULL) {
        return 0;
    }
    /* borrowed, kept alive by the frame */
    PyObject *func = nns_frame_function(frame);
    PyObject *base = cs->rewritten != NULL ? cs->rewritten : (PyObject *)code;
    PyObject *args[3] = {func != NULL ? func : Py_None, base, checked ? Py_True : Py_False};
    /* The decision is our own Python: no code of its own is replaced meanwhile. */
    int mode = capture_code_mode;
    set_mode(0);
    PyObject *result = PyObject_Vectorcall(nns_globals.capture_code, args, 3, NULL);
    set_mode(mode);
    if (result == NULL) {
        if (checked) {
            return -1;
        }
        cs->capture_known[checked] = 1;   /* the frame runs as it is, and so will the next */
        return nns_report_internal_error("writing the capture code of a frame") < 0 ? -1 : 0;
    }
    if (result != Py_None && !PyCode_Check(result)) {
        PyErr_Format(PyExc_TypeError, "capture_code() returned %.100s, not a code object",
                     Py_TYPE(result)->tp_name);
        Py_DECREF(result);
        return checked ? -1 : (nns_report_internal_error("writing the capture code") < 0 ? -1 : 0);
    }
    if (func == NULL) {
        /* Without a function object the frame cannot run other code: decided per frame. */
        Py_DECREF(result);
        return 0;
    }
    /* The decision ran Python, but `cs` is owned by the code object the frame holds. */
    if (result == Py_None) {
        Py_DECREF(result);
    }
    else {
        Py_XSETREF(cs->capture_code[checked], result);   /* moves our reference */
    }
    cs->capture_known[checked] = 1;
    *alt = cs->capture_code[checked];
    return 0;
}
