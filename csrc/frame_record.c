/* frame_record.c - the functions that ran on this thread during a capture. */
#include "frame_record.h"

_Thread_local PyObject *frame_record_set;
Py_ssize_t frame_record_threads;

/* Set when an insertion failed: the record is incomplete. */
static _Thread_local int frame_record_incomplete;

PyObject *
frame_record_replace(PyObject *set)
{
    PyObject *old = frame_record_set;
    frame_record_threads += (set != NULL) - (old != NULL);
    frame_record_set = set;
    return old;
}

void
frame_record_note(NnsFrame *frame)
{
    PyObject *func = nns_frame_function(frame);
    PyObject *set = frame_record_set;
    if (func == NULL || set == NULL) {
        return;
    }
    Py_INCREF(set);   /* a finalizer run by GC during PySet_Add may stop recording */
    if (PySet_Add(set, func) < 0) {
        PyErr_Clear();
        frame_record_incomplete = 1;
    }
    Py_DECREF(set);
}

PyObject *
frame_record_start(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(noargs))
{
    PyObject *set = PySet_New(NULL);
    if (set == NULL) {
        return NULL;
    }
    PyObject *previous = frame_record_replace(set);   /* ownership moves to the caller */
    frame_record_incomplete = 0;
    return previous != NULL ? previous : Py_NewRef(Py_None);
}

PyObject *
frame_record_stop(PyObject *Py_UNUSED(module), PyObject *previous)
{
    if (previous != Py_None && !PySet_Check(previous)) {
        PyErr_SetString(PyExc_TypeError,
                        "record_functions_stop(previous): previous must be what "
                        "record_functions_start returned");
        return NULL;
    }
    PyObject *set = frame_record_replace(previous != Py_None ? Py_NewRef(previous) : NULL);
    if (set == NULL) {
        set = PySet_New(NULL);
        if (set == NULL) {
            return NULL;
        }
    }
    PyObject *result = Py_BuildValue("(Ni)", set, !frame_record_incomplete);
    frame_record_incomplete = 0;
    return result;
}

PyObject *
frame_record_pause(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(noargs))
{
    PyObject *set = frame_record_replace(NULL);   /* ownership moves to the caller */
    return set != NULL ? set : Py_NewRef(Py_None);
}

PyObject *
frame_record_resume(PyObject *Py_UNUSED(module), PyObject *paused)
{
    if (paused != Py_None && !PySet_Check(paused)) {
        PyErr_SetString(PyExc_TypeError,
                        "record_functions_resume(paused): pass what record_functions_pause returned");
        return NULL;
    }
    Py_XDECREF(frame_record_replace(paused != Py_None ? Py_NewRef(paused) : NULL));
    Py_RETURN_NONE;
}
