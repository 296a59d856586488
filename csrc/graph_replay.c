/* graph_replay.c - see graph_replay.h. */
#include "graph_replay.h"

#include <structmember.h>

#include "replay_tensors.h"
#include "tensor_meta.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *inputs;       /* tuple of tensors: the recording's input buffers */
    PyObject *replay;       /* callable(): runs the recording */
    PyObject *outputs;      /* tuple: the recording's outputs */
    PyObject *written;      /* tuple of ints: inputs the graph writes in place */
    char *writes;           /* per input: 1 when in `written` (PyMem) */
    Py_ssize_t *slots;      /* NULL: the arguments are the inputs; else input i = args[slots[i]] */
    Py_ssize_t nargs;       /* the arguments expected */
    int single;             /* return outputs[0] itself */
} GraphReplay;

static int
copy_in(GraphReplay *self, PyObject *const *args, Py_ssize_t i)
{
    PyObject *buffer = PyTuple_GET_ITEM(self->inputs, i);
    PyObject *arg = self->slots != NULL ? args[self->slots[i]] : args[i];
    int same = nns_replay_same_memory(buffer, arg);
    if (same != 0) {
        return same < 0 ? -1 : 0;
    }
    char what[48];
    PyOS_snprintf(what, sizeof(what), "input %zd", i);
    return nns_replay_copy(buffer, arg, what);
}

static int
write_back(GraphReplay *self, PyObject *const *args, Py_ssize_t i)
{
    PyObject *buffer = PyTuple_GET_ITEM(self->inputs, i);
    PyObject *arg = self->slots != NULL ? args[self->slots[i]] : args[i];
    int same = nns_replay_same_memory(buffer, arg);
    if (same != 0) {
        return same < 0 ? -1 : 0;
    }
    char what[48];
    PyOS_snprintf(what, sizeof(what), "input %zd (written back)", i);
    return nns_replay_copy(arg, buffer, what);
}

/* An output handed to the caller: a clone of a tensor (the next replay overwrites
 * the recording's), any other value as it is. */
static PyObject *
output_clone(PyObject *value)
{
    PyTypeObject *tensor, *parameter;
    if (nns_tensor_classes(&tensor, &parameter)) {
        if (Py_IS_TYPE(value, tensor) || Py_IS_TYPE(value, parameter)) {
            return nns_replay_clone(value);
        }
        if (!PyObject_TypeCheck(value, tensor)) {
            return Py_NewRef(value);
        }
    }
    else if (!PyObject_HasAttrString(value, "clone")) {   /* built without torch's headers */
        return Py_NewRef(value);
    }
    return PyObject_CallMethod(value, "clone", NULL);   /* a tensor subclass: its own clone */
}

static PyObject *
graph_replay_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                        PyObject *kwnames)
{
    GraphReplay *self = (GraphReplay *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0) {
        PyErr_SetString(PyExc_TypeError, "a graph replay takes no keyword arguments");
        return NULL;
    }
    if (nargs != self->nargs) {
        PyErr_Format(PyExc_TypeError, "a graph replay takes %zd arguments (%zd given)",
                     self->nargs, nargs);
        return NULL;
    }
    PyObject *result = NULL;
    Py_INCREF(self);    /* replay() may drop every other reference */
    Py_ssize_t n = PyTuple_GET_SIZE(self->inputs);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (copy_in(self, args, i) < 0) {
            goto done;
        }
    }
    PyObject *ran = PyObject_CallNoArgs(self->replay);
    if (ran == NULL) {
        goto done;
    }
    Py_DECREF(ran);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (self->writes[i] && write_back(self, args, i) < 0) {
            goto done;
        }
    }
    Py_ssize_t m = PyTuple_GET_SIZE(self->outputs);
    if (self->single) {
        result = output_clone(PyTuple_GET_ITEM(self->outputs, 0));
        goto done;
    }
    if ((result = PyTuple_New(m)) == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *item = output_clone(PyTuple_GET_ITEM(self->outputs, i));
        if (item == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyTuple_SET_ITEM(result, i, item);
    }
done:
    Py_DECREF(self);
    return result;
}

/* A new GraphReplay of `inputs`, `replay`, `outputs` and `written` (checked here),
 * taking `nargs` arguments mapped by `slots` (NULL: the inputs themselves). */
static PyObject *
graph_replay_make(PyTypeObject *type, PyObject *inputs, PyObject *replay, PyObject *written,
                  PyObject *outputs, const Py_ssize_t *slots, Py_ssize_t nargs, int single)
{
    if (!PyTuple_Check(inputs) || !PyTuple_Check(outputs) || !PyTuple_Check(written)) {
        PyErr_SetString(PyExc_TypeError,
                        "GraphReplay(inputs, replay, written, outputs): inputs, written and "
                        "outputs must be tuples");
        return NULL;
    }
    if (!PyCallable_Check(replay)) {
        PyErr_Format(PyExc_TypeError, "GraphReplay: replay must be callable, not %.200s",
                     Py_TYPE(replay)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(inputs);
    if (single && PyTuple_GET_SIZE(outputs) != 1) {
        PyErr_Format(PyExc_ValueError, "GraphReplay: a single output needs a recording of "
                     "one output, not %zd", PyTuple_GET_SIZE(outputs));
        return NULL;
    }
    GraphReplay *self = (GraphReplay *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = graph_replay_vectorcall;
    self->inputs = Py_NewRef(inputs);
    self->replay = Py_NewRef(replay);
    self->outputs = Py_NewRef(outputs);
    self->written = Py_NewRef(written);
    self->nargs = nargs;
    self->single = single;
    self->writes = PyMem_Calloc((size_t)n + 1, 1);
    if (self->writes == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(written); i++) {
        Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(written, i));
        if (index == -1 && PyErr_Occurred()) {
            Py_DECREF(self);
            return NULL;
        }
        if (index < 0 || index >= n) {
            PyErr_Format(PyExc_IndexError, "GraphReplay: written input %zd out of range "
                         "(%zd inputs)", index, n);
            Py_DECREF(self);
            return NULL;
        }
        self->writes[index] = 1;
    }
    if (slots != NULL) {
        self->slots = PyMem_Malloc(sizeof(Py_ssize_t) * ((size_t)n + 1));
        if (self->slots == NULL) {
            Py_DECREF(self);
            return PyErr_NoMemory();
        }
        memcpy(self->slots, slots, sizeof(Py_ssize_t) * (size_t)n);
    }
    return (PyObject *)self;
}

static PyObject *
graph_replay_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"inputs", "replay", "written", "outputs", "single", NULL};
    PyObject *inputs, *replay, *written, *outputs;
    int single = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|$p:GraphReplay", kwlist, &inputs,
                                     &replay, &written, &outputs, &single)) {
        return NULL;
    }
    return graph_replay_make(type, inputs, replay, written, outputs, NULL,
                             PyTuple_Check(inputs) ? PyTuple_GET_SIZE(inputs) : 0, single);
}

static PyObject *
graph_replay_for_slots(GraphReplay *self, PyObject *args)
{
    PyObject *slots;
    Py_ssize_t nargs;
    int single;
    if (!PyArg_ParseTuple(args, "Onp:for_slots", &slots, &nargs, &single)) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(self->inputs);
    if (!PyTuple_Check(slots) || PyTuple_GET_SIZE(slots) != n) {
        PyErr_Format(PyExc_ValueError, "for_slots: slots must be a tuple of %zd indices", n);
        return NULL;
    }
    Py_ssize_t *map = PyMem_Malloc(sizeof(Py_ssize_t) * ((size_t)n + 1));
    if (map == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        map[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(slots, i));
        if (map[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(map);
            return NULL;
        }
        if (map[i] < 0 || map[i] >= nargs) {
            PyErr_Format(PyExc_IndexError, "for_slots: slot %zd out of range (%zd arguments)",
                         map[i], nargs);
            PyMem_Free(map);
            return NULL;
        }
    }
    PyObject *made = graph_replay_make(Py_TYPE(self), self->inputs, self->replay, self->written,
                                       self->outputs, map, nargs, single);
    PyMem_Free(map);
    return made;
}

static int
graph_replay_traverse(GraphReplay *self, visitproc visit, void *arg)
{
    Py_VISIT(self->inputs);
    Py_VISIT(self->replay);
    Py_VISIT(self->outputs);
    Py_VISIT(self->written);
    return 0;
}

static int
graph_replay_clear(GraphReplay *self)
{
    Py_CLEAR(self->inputs);
    Py_CLEAR(self->replay);
    Py_CLEAR(self->outputs);
    Py_CLEAR(self->written);
    return 0;
}

static void
graph_replay_dealloc(GraphReplay *self)
{
    PyObject_GC_UnTrack(self);
    graph_replay_clear(self);
    PyMem_Free(self->writes);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef graph_replay_members[] = {
    {"inputs", T_OBJECT, offsetof(GraphReplay, inputs), READONLY, "the input buffers"},
    {"replay", T_OBJECT, offsetof(GraphReplay, replay), READONLY, "runs the recording"},
    {"outputs", T_OBJECT, offsetof(GraphReplay, outputs), READONLY, "the output buffers"},
    {"written", T_OBJECT, offsetof(GraphReplay, written), READONLY,
     "the inputs the graph writes in place"},
    {"single", T_INT, offsetof(GraphReplay, single), READONLY,
     "returns the one output itself, not a tuple"},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(GraphReplay, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef graph_replay_methods[] = {
    {"for_slots", (PyCFunction)graph_replay_for_slots, METH_VARARGS,
     "for_slots(slots, nargs, single): this recording called with a frame's nargs slots "
     "(input i is slot slots[i]); `single` returns the one output itself."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject GraphReplay_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.GraphReplay",
    .tp_basicsize = sizeof(GraphReplay),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "GraphReplay(inputs, replay, written, outputs, *, single=False): a recorded "
              "graph's replay "
              "(csrc/graph_replay.h).",
    .tp_new = graph_replay_new,
    .tp_dealloc = (destructor)graph_replay_dealloc,
    .tp_traverse = (traverseproc)graph_replay_traverse,
    .tp_clear = (inquiry)graph_replay_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(GraphReplay, vectorcall),
    .tp_members = graph_replay_members,
    .tp_methods = graph_replay_methods,
};
