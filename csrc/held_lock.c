/* held_lock.c - a lock held for exactly one call (see held_lock.h). */
#include "held_lock.h"

static PyObject *str_acquire, *str_release;

static int
names_ready(void)
{
    if (str_release != NULL) {
        return 0;
    }
    str_acquire = PyUnicode_InternFromString("acquire");
    str_release = str_acquire != NULL ? PyUnicode_InternFromString("release") : NULL;
    return str_release != NULL ? 0 : -1;
}

PyObject *
call_holding(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
             PyObject *kwnames)
{
    if (nargs < 2) {
        PyErr_SetString(PyExc_TypeError, "call_holding(lock, fn, /, *args, **kwargs)");
        return NULL;
    }
    if (names_ready() < 0) {
        return NULL;
    }
    PyObject *lock = args[0];
    PyObject *acquired = PyObject_CallMethodNoArgs(lock, str_acquire);
    if (acquired == NULL) {
        return NULL;   /* not held: a handler raised while it waited, or no such method */
    }
    int held = PyObject_IsTrue(acquired);
    Py_DECREF(acquired);
    if (held <= 0) {
        if (held == 0) {
            PyErr_Format(PyExc_RuntimeError,
                         "call_holding: %.100s.acquire() returned without the lock",
                         Py_TYPE(lock)->tp_name);
        }
        return NULL;
    }
    PyObject *result = PyObject_Vectorcall(args[1], args + 2, (size_t)(nargs - 2), kwnames);
    /* Released with fn's exception (if any) set aside and put back after. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *released = PyObject_CallMethodNoArgs(lock, str_release);
    if (released == NULL) {
        Py_XDECREF(result);
        if (type == NULL) {
            return NULL;   /* the release's error */
        }
        /* fn's error is what the caller sees; the release's is reported aside */
        PyErr_WriteUnraisable(lock);
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    Py_DECREF(released);
    PyErr_Restore(type, value, tb);
    return result;
}
