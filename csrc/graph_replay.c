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
    PyObject *pinned;       /* tuple of ints: inputs whose buffer is the caller's tensor */
    PyObject *moved;        /* callable(*inputs) for a pinned input elsewhere, or None */
    PyObject *input_views;  /* NULL, or per input None or the leading part of its buffer
                               that a call fills (for_sizes) */
    PyObject *output_views; /* NULL, or per output None or the leading part handed out */
    char *flags;            /* per input: WRITTEN | PINNED (PyMem) */
    Py_ssize_t *slots;      /* NULL: the arguments are the inputs; else input i = args[slots[i]] */
    Py_ssize_t nargs;       /* the arguments expected */
    int single;             /* return outputs[0] itself */
} GraphReplay;

enum { WRITTEN = 1, PINNED = 2, CONSTANT = 4, FREE = 8 };

/* An input that is not a tensor (a size of a dynamic capture recorded per size, as
 * an int) is part of the recording: the argument must equal it. */
static int
is_plain_tensor(PyObject *obj)
{
    PyTypeObject *tensor, *parameter;
    return nns_tensor_classes(&tensor, &parameter) &&
           (Py_IS_TYPE(obj, tensor) || Py_IS_TYPE(obj, parameter));
}

/* Input or output i's buffer as a call sees it: the whole buffer, or the leading
 * part for_sizes made for a call of smaller sizes. */
static PyObject *
seen(PyObject *buffers, PyObject *views, Py_ssize_t i)
{
    PyObject *view = views != NULL ? PyTuple_GET_ITEM(views, i) : Py_None;
    return view != Py_None ? view : PyTuple_GET_ITEM(buffers, i);
}

static int
copy_in(GraphReplay *self, PyObject *const *args, Py_ssize_t i)
{
    PyObject *buffer = seen(self->inputs, self->input_views, i);
    PyObject *arg = self->slots != NULL ? args[self->slots[i]] : args[i];
    if (self->flags[i] & FREE) {
        return 0;   /* a size of the call: the recording runs at its own (for_sizes) */
    }
    if (self->flags[i] & CONSTANT) {
        int equal = arg == buffer ? 1 : PyObject_RichCompareBool(arg, buffer, Py_EQ);
        if (equal == 0) {
            PyErr_Format(PyExc_ValueError, "graph replay: input %zd is %R, the recording's %R",
                         i, arg, buffer);
        }
        return equal == 1 ? 0 : -1;
    }
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

/* A pinned input's argument is not the recorded tensor: the recording cannot run
 * (copying into the caller's earlier tensor would change it behind their back).
 * `moved(*inputs)` answers instead, a tuple of outputs like the replay's. */
static PyObject *
call_moved(GraphReplay *self, PyObject *const *args, Py_ssize_t n)
{
    if (self->moved == Py_None) {
        PyErr_SetString(PyExc_ValueError, "graph replay: a pinned input is not the recorded "
                                          "tensor and no `moved` handler was given");
        return NULL;
    }
    PyObject *small[8];
    PyObject **inputs = n <= 8 ? small : PyMem_Malloc(sizeof(PyObject *) * (size_t)n);
    if (inputs == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        inputs[i] = self->slots != NULL ? args[self->slots[i]] : args[i];
    }
    PyObject *result = PyObject_Vectorcall(self->moved, inputs, (size_t)n, NULL);
    if (inputs != small) {
        PyMem_Free(inputs);
    }
    if (result == NULL || !self->single) {
        return result;
    }
    if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 1) {
        PyErr_SetString(PyExc_TypeError, "graph replay: `moved` must return a tuple of outputs");
        Py_DECREF(result);
        return NULL;
    }
    PyObject *one = Py_NewRef(PyTuple_GET_ITEM(result, 0));
    Py_DECREF(result);
    return one;
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
    Py_INCREF(self);    /* replay() and moved() may drop every other reference */
    Py_ssize_t n = PyTuple_GET_SIZE(self->inputs);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!(self->flags[i] & PINNED)) {
            continue;
        }
        int same = nns_replay_same_memory(PyTuple_GET_ITEM(self->inputs, i),
                                          self->slots != NULL ? args[self->slots[i]] : args[i]);
        if (same < 0) {
            goto done;
        }
        if (!same) {
            result = call_moved(self, args, n);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!(self->flags[i] & PINNED) && copy_in(self, args, i) < 0) {
            goto done;
        }
    }
    PyObject *ran = PyObject_CallNoArgs(self->replay);
    if (ran == NULL) {
        goto done;
    }
    Py_DECREF(ran);
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((self->flags[i] & WRITTEN) && write_back(self, args, i) < 0) {
            goto done;
        }
    }
    Py_ssize_t m = PyTuple_GET_SIZE(self->outputs);
    if (self->single) {
        result = output_clone(seen(self->outputs, self->output_views, 0));
        goto done;
    }
    if ((result = PyTuple_New(m)) == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *item = output_clone(seen(self->outputs, self->output_views, i));
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
/* Sets `flag` in `flags` for each index of the tuple `indices` (checked: 0 <= i < n). */
static int
mark_inputs(char *flags, PyObject *indices, Py_ssize_t n, char flag, const char *what)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(indices); i++) {
        Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(indices, i));
        if (index == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (index < 0 || index >= n) {
            PyErr_Format(PyExc_IndexError, "GraphReplay: %s input %zd out of range (%zd inputs)",
                         what, index, n);
            return -1;
        }
        flags[index] |= flag;
    }
    return 0;
}

static PyObject *
graph_replay_make(PyTypeObject *type, PyObject *inputs, PyObject *replay, PyObject *written,
                  PyObject *outputs, PyObject *pinned, PyObject *moved, const Py_ssize_t *slots,
                  Py_ssize_t nargs, int single)
{
    if (!PyTuple_Check(inputs) || !PyTuple_Check(outputs) || !PyTuple_Check(written) ||
        !PyTuple_Check(pinned)) {
        PyErr_SetString(PyExc_TypeError,
                        "GraphReplay(inputs, replay, written, outputs): inputs, written, "
                        "outputs and pinned must be tuples");
        return NULL;
    }
    if (moved != Py_None && !PyCallable_Check(moved)) {
        PyErr_Format(PyExc_TypeError, "GraphReplay: moved must be callable or None, not %.200s",
                     Py_TYPE(moved)->tp_name);
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
    self->pinned = Py_NewRef(pinned);
    self->moved = Py_NewRef(moved);
    self->nargs = nargs;
    self->single = single;
    self->flags = PyMem_Calloc((size_t)n + 1, 1);
    if (self->flags == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* without torch's headers every input is taken for a tensor */
        PyTypeObject *tensor, *parameter;
        if (nns_tensor_classes(&tensor, &parameter) &&
            !is_plain_tensor(PyTuple_GET_ITEM(inputs, i))) {
            self->flags[i] = CONSTANT;
        }
    }
    if (mark_inputs(self->flags, written, n, WRITTEN, "written") < 0 ||
        mark_inputs(self->flags, pinned, n, PINNED, "pinned") < 0) {
        Py_DECREF(self);
        return NULL;
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
    static char *kwlist[] = {"inputs", "replay", "written", "outputs", "single", "pinned",
                             "moved", NULL};
    PyObject *inputs, *replay, *written, *outputs, *pinned = NULL, *moved = Py_None;
    int single = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|$pOO:GraphReplay", kwlist, &inputs,
                                     &replay, &written, &outputs, &single, &pinned, &moved)) {
        return NULL;
    }
    PyObject *none = pinned == NULL ? PyTuple_New(0) : Py_NewRef(pinned);
    if (none == NULL) {
        return NULL;
    }
    PyObject *made = graph_replay_make(type, inputs, replay, written, outputs, none, moved, NULL,
                                       PyTuple_Check(inputs) ? PyTuple_GET_SIZE(inputs) : 0,
                                       single);
    Py_DECREF(none);
    return made;
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
    GraphReplay *made = (GraphReplay *)graph_replay_make(
        Py_TYPE(self), self->inputs, self->replay, self->written, self->outputs, self->pinned,
        self->moved, map, nargs, single);
    PyMem_Free(map);
    if (made != NULL && self->input_views != NULL) {   /* a bucket's call stays one */
        made->input_views = Py_NewRef(self->input_views);
        made->output_views = Py_NewRef(self->output_views);
        for (Py_ssize_t i = 0; i < n; i++) {
            made->flags[i] |= self->flags[i] & FREE;
        }
    }
    return (PyObject *)made;
}

/* Per buffer of `buffers`, None or the view of the leading `sizes[i]` (a tuple of
 * ints, or None for all of it): a new tuple, or NULL with an exception. */
static PyObject *
leading_views(PyObject *buffers, PyObject *sizes, const char *what)
{
    Py_ssize_t n = PyTuple_GET_SIZE(buffers);
    if (PyTuple_GET_SIZE(sizes) != n) {
        PyErr_Format(PyExc_ValueError, "for_sizes: %s sizes must have one entry per %s (%zd)",
                     what, what, n);
        return NULL;
    }
    PyObject *views = PyTuple_New(n);
    for (Py_ssize_t i = 0; views != NULL && i < n; i++) {
        PyObject *kept = PyTuple_GET_ITEM(sizes, i), *view;
        char where[48];
        PyOS_snprintf(where, sizeof(where), "%s %zd", what, i);
        if (kept == Py_None) {
            view = Py_NewRef(Py_None);
        }
        else if (!PyTuple_Check(kept)) {
            PyErr_Format(PyExc_TypeError, "for_sizes: %s's sizes must be a tuple of ints or "
                         "None, not %.200s", where, Py_TYPE(kept)->tp_name);
            view = NULL;
        }
        else if (!is_plain_tensor(PyTuple_GET_ITEM(buffers, i))) {
            PyErr_Format(PyExc_ValueError, "for_sizes: %s is not a tensor: it has no sizes "
                         "to keep", where);
            view = NULL;
        }
        else {
            view = nns_replay_leading(PyTuple_GET_ITEM(buffers, i), kept, where);
        }
        if (view == NULL) {
            Py_CLEAR(views);
            break;
        }
        PyTuple_SET_ITEM(views, i, view);
    }
    return views;
}

static PyObject *
graph_replay_for_sizes(GraphReplay *self, PyObject *args)
{
    PyObject *free, *kept_inputs, *kept_outputs;
    if (!PyArg_ParseTuple(args, "O!O!O!:for_sizes", &PyTuple_Type, &free, &PyTuple_Type,
                          &kept_inputs, &PyTuple_Type, &kept_outputs)) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(self->inputs);
    PyObject *input_views = leading_views(self->inputs, kept_inputs, "input");
    PyObject *output_views = input_views == NULL ? NULL
                             : leading_views(self->outputs, kept_outputs, "output");
    GraphReplay *made = output_views == NULL ? NULL : (GraphReplay *)graph_replay_make(
        Py_TYPE(self), self->inputs, self->replay, self->written, self->outputs, self->pinned,
        self->moved, self->slots, self->nargs, self->single);
    if (made == NULL) {
        Py_XDECREF(input_views);
        Py_XDECREF(output_views);
        return NULL;
    }
    made->input_views = input_views;
    made->output_views = output_views;
    if (mark_inputs(made->flags, free, n, FREE, "free") < 0) {
        Py_DECREF(made);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((made->flags[i] & FREE) && !(made->flags[i] & CONSTANT)) {
            PyErr_Format(PyExc_ValueError, "for_sizes: free input %zd is a tensor (only a "
                         "size given as a number may differ from the recording's)", i);
            Py_DECREF(made);
            return NULL;
        }
        if ((made->flags[i] & (PINNED | WRITTEN)) &&
            PyTuple_GET_ITEM(input_views, i) != Py_None) {
            PyErr_Format(PyExc_ValueError, "for_sizes: input %zd is pinned or written in "
                         "place: it cannot be a part of its buffer", i);
            Py_DECREF(made);
            return NULL;
        }
    }
    return (PyObject *)made;
}

static int
graph_replay_traverse(GraphReplay *self, visitproc visit, void *arg)
{
    Py_VISIT(self->inputs);
    Py_VISIT(self->replay);
    Py_VISIT(self->outputs);
    Py_VISIT(self->written);
    Py_VISIT(self->pinned);
    Py_VISIT(self->moved);
    Py_VISIT(self->input_views);
    Py_VISIT(self->output_views);
    return 0;
}

static int
graph_replay_clear(GraphReplay *self)
{
    Py_CLEAR(self->inputs);
    Py_CLEAR(self->replay);
    Py_CLEAR(self->outputs);
    Py_CLEAR(self->written);
    Py_CLEAR(self->pinned);
    Py_CLEAR(self->moved);
    Py_CLEAR(self->input_views);
    Py_CLEAR(self->output_views);
    return 0;
}

static void
graph_replay_dealloc(GraphReplay *self)
{
    PyObject_GC_UnTrack(self);
    graph_replay_clear(self);
    PyMem_Free(self->flags);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef graph_replay_members[] = {
    {"inputs", T_OBJECT, offsetof(GraphReplay, inputs), READONLY, "the input buffers"},
    {"replay", T_OBJECT, offsetof(GraphReplay, replay), READONLY, "runs the recording"},
    {"outputs", T_OBJECT, offsetof(GraphReplay, outputs), READONLY, "the output buffers"},
    {"written", T_OBJECT, offsetof(GraphReplay, written), READONLY,
     "the inputs the graph writes in place"},
    {"pinned", T_OBJECT, offsetof(GraphReplay, pinned), READONLY,
     "the inputs whose buffer is the caller's own tensor (never copied)"},
    {"moved", T_OBJECT, offsetof(GraphReplay, moved), READONLY,
     "called with the inputs when a pinned one is not the recorded tensor"},
    {"single", T_INT, offsetof(GraphReplay, single), READONLY,
     "returns the one output itself, not a tuple"},
    {"input_views", T_OBJECT, offsetof(GraphReplay, input_views), READONLY,
     "None, or per input None or the leading part of its buffer a call fills (for_sizes)"},
    {"output_views", T_OBJECT, offsetof(GraphReplay, output_views), READONLY,
     "None, or per output None or the leading part handed out (for_sizes)"},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(GraphReplay, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef graph_replay_methods[] = {
    {"for_slots", (PyCFunction)graph_replay_for_slots, METH_VARARGS,
     "for_slots(slots, nargs, single): this recording called with a frame's nargs slots "
     "(input i is slot slots[i]); `single` returns the one output itself."},
    {"for_sizes", (PyCFunction)graph_replay_for_sizes, METH_VARARGS,
     "for_sizes(free, kept_inputs, kept_outputs): this recording run for a call of "
     "smaller sizes (a padded bucket): argument i is copied into the leading "
     "kept_inputs[i] positions of its buffer, output i's leading kept_outputs[i] "
     "positions are cloned out (None: all of it), and the int inputs in `free` are the "
     "call's own sizes (the recording's are used)."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject GraphReplay_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.GraphReplay",
    .tp_basicsize = sizeof(GraphReplay),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "GraphReplay(inputs, replay, written, outputs, *, single, pinned, moved): a "
              "recorded graph's replay (csrc/graph_replay.h); the keyword-only arguments are "
              "optional: single False, pinned no input, moved None.",
    .tp_new = graph_replay_new,
    .tp_dealloc = (destructor)graph_replay_dealloc,
    .tp_traverse = (traverseproc)graph_replay_traverse,
    .tp_clear = (inquiry)graph_replay_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(GraphReplay, vectorcall),
    .tp_members = graph_replay_members,
    .tp_methods = graph_replay_methods,
};
