/* code_state.c - per-code-object state in co_extra. */
#include "code_state.h"
#include "nns_globals.h"
#include "rewrite.h"

static void
code_state_free(void *ptr)
{
    CodeState *cs = (CodeState *)ptr;
    if (cs == NULL) {
        return;
    }
    Py_CLEAR(cs->rewritten);
    Py_CLEAR(cs->capture_code[0]);
    Py_CLEAR(cs->capture_code[1]);
    cache_tables_clear(&cs->tables);
    PyMem_Free(cs);
}

/* Set by code_state_init when nns_code_extra_read finds what the public setter
 * stored (code_state.h). */
int code_state_direct;

static CodeState *code_state_new(PyCodeObject *code);

/* 1 when nns_code_extra_read sees a CodeState set through the public API on a
 * throwaway code object (freed with it, by code_state_free), 0 when it does not,
 * -1 with an exception set. */
static int
direct_read_works(void)
{
    PyCodeObject *code = PyCode_NewEmpty("<nnscaler co_extra check>", "check", 1);
    if (code == NULL) {
        return -1;
    }
    CodeState *cs = code_state_new(code);
    int works = cs != NULL && nns_code_extra_read(code, nns_globals.code_extra_index) == cs;
    Py_DECREF(code);
    if (cs == NULL) {
        return -1;
    }
    return works;
}

int
code_state_init(void)
{
    if (nns_globals.code_extra_index >= 0) {
        return 0;
    }
    Py_ssize_t index = nns_code_request_extra_index(code_state_free);
    if (index < 0) {
        PyErr_SetString(PyExc_RuntimeError, "nnscaler: no co_extra slot left");
        return -1;
    }
    nns_globals.code_extra_index = index;
    int works = direct_read_works();
    if (works < 0) {
        return -1;
    }
    code_state_direct = works;
    return 0;
}

CodeState *
code_state_peek_api(PyCodeObject *code)
{
    void *extra = NULL;
    if (nns_code_get_extra((PyObject *)code, nns_globals.code_extra_index, &extra) < 0) {
        PyErr_Clear();
        return NULL;
    }
    return (CodeState *)extra;
}

static CodeState *
code_state_new(PyCodeObject *code)
{
    CodeState *cs = PyMem_Calloc(1, sizeof(CodeState));
    if (cs == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (nns_code_set_extra((PyObject *)code, nns_globals.code_extra_index, cs) < 0) {
        PyMem_Free(cs);
        return NULL;
    }
    return cs;
}

int
code_state_mark_skip(PyCodeObject *code)
{
    CodeState *cs = code_state_peek(code);
    if (cs == NULL && (cs = code_state_new(code)) == NULL) {
        return -1;
    }
    cs->flags |= CS_SKIP;
    return 0;
}

static int
is_skipped_code(PyCodeObject *code)
{
    const int not_plain = CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR | CO_ITERABLE_COROUTINE;
    if (code->co_flags & not_plain) {
        return 1;
    }
    /* Module and class bodies run with a locals mapping; never ours to replace. */
    return !(code->co_flags & CO_OPTIMIZED) || !(code->co_flags & CO_NEWLOCALS);
}

/* The code object of a plain function, or of a method bound to `self`; else NULL. */
static PyCodeObject *
forward_code(PyObject *fn, PyObject *self)
{
    if (fn != NULL && PyMethod_Check(fn) && PyMethod_GET_SELF(fn) == self) {
        fn = PyMethod_GET_FUNCTION(fn);
    }
    return fn != NULL && PyFunction_Check(fn) ? (PyCodeObject *)PyFunction_GET_CODE(fn) : NULL;
}

void
code_state_learn_forward(CodeState *cs, PyCodeObject *code, PyObject *module)
{
    if ((cs->flags & (CS_FORWARD | CS_SKIP)) || code->co_argcount < 1) {
        return;
    }
    PyObject *dict = nns_object_dict(module);
    PyObject *fn = NULL;
    if (dict != NULL) {
        Py_INCREF(dict);
        fn = PyDict_GetItemWithError(dict, nns_globals.str_forward);   /* borrowed */
        if (fn == NULL && PyErr_Occurred()) {
            PyErr_Clear();
        }
        Py_XINCREF(fn);
        Py_DECREF(dict);
    }
    if (fn == NULL) {
        fn = Py_XNewRef(nns_type_lookup(Py_TYPE(module), nns_globals.str_forward));
    }
    /* A decorated forward (transformers' can_return_tuple, functools.wraps): the
     * function the decorators wrapped is the forward, never their generic wrapper,
     * whose one code object serves every class it decorates. */
    for (int depth = 0; depth < 8 && fn != NULL; depth++) {
        PyObject *function = PyMethod_Check(fn) ? PyMethod_GET_FUNCTION(fn) : fn;
        PyObject *wrapped = NULL;
        if (PyFunction_Check(function)) {
            PyObject *fdict = PyObject_GenericGetDict(function, NULL);
            if (fdict == NULL) {
                PyErr_Clear();
            }
            else {
                wrapped = PyDict_GetItemWithError(fdict, nns_globals.str_wrapped);
                Py_XINCREF(wrapped);
                if (wrapped == NULL && PyErr_Occurred()) {
                    PyErr_Clear();
                }
                Py_DECREF(fdict);
            }
        }
        if (wrapped == NULL) {
            break;
        }
        Py_SETREF(fn, wrapped);
    }
    if (forward_code(fn, module) == code) {
        cs->flags = (cs->flags | CS_FORWARD) & ~(unsigned)CS_PLAIN;
    }
    Py_XDECREF(fn);
}

CodeState *
code_state_get(PyCodeObject *code)
{
    CodeState *cs = code_state_peek(code);
    if (cs != NULL) {
        return cs;
    }
    cs = code_state_new(code);
    if (cs == NULL) {
        return NULL;
    }
    if (is_skipped_code(code)) {
        cs->flags |= CS_SKIP;
        return cs;
    }
    if (code->co_argcount >= 1 &&
        PyUnicode_Compare(code->co_name, nns_globals.str_forward) == 0) {
        cs->flags |= CS_FORWARD;
    }
    if (rewrite_may_apply(code)) {
        int n_sites = 0;
        PyObject *rewritten = rewrite_training_ifexpr(code, nns_globals.ifexpr, &n_sites);
        if (rewritten == NULL) {
            /* Fail open: the frame runs its original code; the error becomes a warning. */
            if (nns_report_internal_error("bytecode rewrite") < 0) {
                return NULL;
            }
        }
        else if (n_sites == 0) {
            Py_DECREF(rewritten);
        }
        else {
            if (code_state_mark_skip((PyCodeObject *)rewritten) < 0) {
                Py_DECREF(rewritten);
                return NULL;
            }
            cs->rewritten = rewritten;
            cs->n_sites = n_sites;
        }
    }
    if (!(cs->flags & CS_FORWARD) && cs->rewritten == NULL) {
        cs->flags |= CS_PLAIN;
    }
    return cs;
}
