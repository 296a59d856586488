/* rewrite.c - placeholder until the bytecode rewrite lands (same commit series). */
#include "rewrite.h"

int
rewrite_may_apply(PyCodeObject *code)
{
    (void)code;
    return 0;
}

PyObject *
rewrite_training_ifexpr(PyCodeObject *code, PyObject *ifexpr, int *n_sites)
{
    (void)ifexpr;
    *n_sites = 0;
    return Py_NewRef((PyObject *)code);
}
