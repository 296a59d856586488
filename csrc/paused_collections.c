/* paused_collections.c - one call during which no garbage collection runs (see
 * paused_collections.h). */
#include "paused_collections.h"

PyObject *
call_without_collections(PyObject *Py_UNUSED(module), PyObject *const *args,
                         Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "call_without_collections(fn, /, *args, **kwargs)");
        return NULL;
    }
    int collecting = PyGC_Disable();   /* whether collections ran before */
    PyObject *result = PyObject_Vectorcall(args[0], args + 1, (size_t)(nargs - 1), kwnames);
    if (collecting) {
        PyGC_Enable();
    }
    return result;
}
