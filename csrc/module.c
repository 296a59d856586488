/* module.c - nnscaler_eval._C: module init and the Python-visible functions.
 * (Grows with eval_frame.c and guards/.) */
#include "bytecode.h"
#include "compat.h"
#include "rewrite.h"

PyDoc_STRVAR(rewrite_code_doc,
"rewrite_code(code, ifexpr) -> (code, n_sites)\n\n"
"Rewrite the `self.training` conditional expressions of `code` into calls of\n"
"`ifexpr`; returns the new code object (or `code` itself) and the site count.");

static PyObject *
rewrite_code(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyCode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "rewrite_code(code, ifexpr): code must be a code object");
        return NULL;
    }
    int n_sites = 0;
    PyObject *code = rewrite_training_ifexpr((PyCodeObject *)args[0], args[1], &n_sites);
    if (code == NULL) {
        return NULL;
    }
    return Py_BuildValue("(Ni)", code, n_sites);
}

PyDoc_STRVAR(bytecode_roundtrip_doc,
"_bytecode_roundtrip(code) -> code\n\n"
"Decode `code` into the rewrite's instruction list and assemble it back unchanged\n"
"(a test of the bytecode layer; not a public API).");

static PyObject *
bytecode_roundtrip_py(PyObject *Py_UNUSED(module), PyObject *code)
{
    if (!PyCode_Check(code)) {
        PyErr_SetString(PyExc_TypeError, "_bytecode_roundtrip(code): code must be a code object");
        return NULL;
    }
    return bytecode_roundtrip((PyCodeObject *)code);
}

static PyMethodDef module_methods[] = {
    {"rewrite_code", (PyCFunction)(void (*)(void))rewrite_code, METH_FASTCALL, rewrite_code_doc},
    {"_bytecode_roundtrip", bytecode_roundtrip_py, METH_O, bytecode_roundtrip_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef_Slot module_slots[] = {
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "nnscaler_eval._C",
    .m_doc = "C core of nnscaler-eval: PEP 523 frame evaluator, bytecode rewrite, guards.",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = module_slots,
};

PyMODINIT_FUNC
PyInit__C(void)
{
    return PyModuleDef_Init(&module_def);
}
