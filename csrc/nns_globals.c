/* nns_globals.c - the process-wide objects of the C core (nns_globals.h) and the
 * reporter of our own errors.  Below every file that uses them: it includes only
 * its header; module.c fills the struct at install. */
#include "nns_globals.h"

NnsGlobals nns_globals = {.code_extra_index = -1};

int
nns_report_internal_error(const char *where)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    /* Only ordinary errors fail open.  KeyboardInterrupt, SystemExit, MemoryError
     * and any other BaseException that is not an Exception propagate. */
    if (type == NULL || !PyErr_GivenExceptionMatches(type, PyExc_Exception) ||
        PyErr_GivenExceptionMatches(type, PyExc_MemoryError)) {
        PyErr_Restore(type, value, tb);
        return -1;
    }
    int rc = PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                              "nnscaler: %s failed (%R); the frame runs without it",
                              where, value ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return rc;
}
