/* cache.c - CacheBucket: the entries of one code object for one `self`.  First what
 * a hit runs, the lookup (cache_lookup, and cache_bucket_runs_eagerly before it),
 * top to bottom; then storing an entry; then the bucket object.  The entries and
 * their check are cache_entry.c's. */
#include <stddef.h>
#include "cache.h"
#include "structmember.h"

/* ------------------------------------------------ the lookup: what a hit runs */

static inline int
key_equal(const CacheEntry *e, const CallKey *key)
{
    if (e->key_len == key->len && memcmp(e->key, key->data, key->len) == 0) {
        return 1;
    }
    return e->shapes != NULL && shape_guards_match(e->shapes, e->key, key->data, key->len);
}

/* Index of `entry` in `entries`, or -1 (a guard check ran Python that changed the
 * list: reset(), a recapture on another thread, the self-collected callback). */
static Py_ssize_t
index_of(PyObject *entries, PyObject *entry, Py_ssize_t hint)
{
    Py_ssize_t n = PyList_GET_SIZE(entries);
    if (hint < n && PyList_GET_ITEM(entries, hint) == entry) {
        return hint;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GET_ITEM(entries, i) == entry) {
            return i;
        }
    }
    return -1;
}

/* Keep the name of the guard that made `entry` stale, for the recapture log (at most
 * a few: the miss path takes them).  Errors are dropped: this is diagnostics only. */
static void
remember_dropped(CacheBucket *bucket, CacheEntry *entry, Py_ssize_t failed)
{
    PyObject *name = (failed >= 0 && failed < PyTuple_GET_SIZE(entry->guard_names))
        ? Py_NewRef(PyTuple_GET_ITEM(entry->guard_names, failed))
        : PyUnicode_FromString("an object the entry refers to was collected");
    if (name == NULL) {
        PyErr_Clear();
        return;
    }
    if (bucket->dropped == NULL) {
        bucket->dropped = PyList_New(0);
    }
    if (bucket->dropped == NULL || PyList_GET_SIZE(bucket->dropped) >= 8 ||
        PyList_Append(bucket->dropped, name) < 0) {
        PyErr_Clear();
    }
    Py_DECREF(name);
}

/* Containers are looked into to this depth (an HF cache passed inside **kwargs is at
 * depth 1); deeper ones reach the miss path, which falls back the same way. */
#define EAGER_TYPES_DEPTH 3

static int
holds_eager_type(PyObject *types, PyObject *value, int depth)
{
    PyTypeObject *tp = Py_TYPE(value);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
        if ((PyObject *)tp == PyTuple_GET_ITEM(PyTuple_GET_ITEM(types, i), 0)) {
            return 1;
        }
    }
    if (depth >= EAGER_TYPES_DEPTH) {
        return 0;
    }
    /* Exact containers only: a subclass's items could come from Python code. Nothing
     * here runs Python, so the borrowed items stay alive. */
    if (tp == &PyTuple_Type || tp == &PyList_Type) {
        for (Py_ssize_t i = 0; i < Py_SIZE(value); i++) {
            PyObject *item = tp == &PyTuple_Type ? PyTuple_GET_ITEM(value, i)
                                                 : PyList_GET_ITEM(value, i);
            if (holds_eager_type(types, item, depth + 1)) {
                return 1;
            }
        }
    }
    else if (tp == &PyDict_Type) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(value, &pos, &k, &v)) {
            if (holds_eager_type(types, v, depth + 1)) {
                return 1;
            }
        }
    }
    return 0;
}

int
cache_bucket_runs_eagerly(CacheBucket *bucket, PyObject *const *args, Py_ssize_t n)
{
    PyObject *types = bucket->eager_types;
    if (types == NULL) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (args[i] != NULL && holds_eager_type(types, args[i], 0)) {
            return 1;
        }
    }
    return 0;
}

CacheEntry *
cache_lookup(CacheBucket *bucket, CallKey *key)
{
    CacheEntry *found = NULL;
    PyObject *entries = bucket->entries;   /* owned below: checks may run Python */
    if (entries == NULL) {
        return NULL;
    }
    Py_INCREF(entries);
    int rescans = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries); i++) {
        CacheEntry *e = (CacheEntry *)PyList_GET_ITEM(entries, i);
        if (!key_equal(e, key)) {
            continue;
        }
        Py_ssize_t failed;
        Py_INCREF(e);
        int ok = cache_entry_check(e, &failed);
        /* The check may have run Python: find the entry again by identity. */
        Py_ssize_t at = index_of(entries, (PyObject *)e, i);
        if (ok == 1 && at >= 0 && entries == bucket->entries) {
            if (at > 0) {
                /* Most recently used first: a steady workload hits at index 0. The
                 * list keeps its own reference throughout the swap. */
                PyObject *first = PyList_GET_ITEM(entries, 0);
                PyList_SET_ITEM(entries, 0, (PyObject *)e);
                PyList_SET_ITEM(entries, at, first);
            }
            found = e;
            Py_DECREF(e);   /* the list still holds it */
            break;
        }
        /* Not a hit, and the check may have run Python (a `training` property, a
         * value guard): the key is not known to describe the arguments any more. */
        key->flags |= CALL_KEY_RAN_PYTHON;
        if (ok < 0 && at >= 0) {
            remember_dropped(bucket, e, failed);
            /* Stale for good. Dropping it runs no Python that reaches this list:
             * entries hold no finalizers of ours (their runners' globals may, but
             * the list owns no borrowed slot we read afterwards). */
            if (PySequence_DelItem(entries, at) < 0) {
                PyErr_Clear();
                Py_DECREF(e);
                break;
            }
            i = at - 1;
        }
        else if (at >= 0) {
            i = at;
        }
        else if (++rescans <= 2) {
            i = -1;   /* the list changed under us: rescan from the start */
        }
        else {
            Py_DECREF(e);
            break;    /* a guard keeps changing it: no hit (the call recaptures) */
        }
        Py_DECREF(e);
    }
    Py_DECREF(entries);
    return found;
}

/* -------------------------------------------------------- storing an entry */

/* The weak references in `pins` (a list of weakrefs and strongly held objects), each
 * once, into a new PyMem array (NULL when there are none).  A key pins the class of
 * every tensor it describes, so one weakref recurs once per tensor; a repeat within
 * the last PIN_WINDOW distinct ones is dropped (one further away is kept: checking
 * it twice is only redundant).  Runs no Python.  0, or -1 with MemoryError. */
#define PIN_WINDOW 8
static int
collect_weak_pins(PyObject *pins, PyObject ***out, Py_ssize_t *n_out)
{
    Py_ssize_t n = PyList_GET_SIZE(pins), kept = 0;
    *out = NULL;
    *n_out = 0;
    if (n == 0) {
        return 0;
    }
    PyObject **refs = PyMem_Malloc(sizeof(PyObject *) * (size_t)n);
    if (refs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pin = PyList_GET_ITEM(pins, i);
        if (!PyWeakref_CheckRef(pin)) {
            continue;
        }
        int repeat = 0;
        for (Py_ssize_t j = kept - 1; j >= 0 && j >= kept - PIN_WINDOW; j--) {
            if (refs[j] == pin) {
                repeat = 1;
                break;
            }
        }
        if (!repeat) {
            refs[kept++] = pin;
        }
    }
    if (kept == 0) {
        PyMem_Free(refs);
        return 0;
    }
    *out = refs;
    *n_out = kept;
    return 0;
}

int
cache_insert(CacheBucket *bucket, CacheEntry *entry, const CallKey *key)
{
    if (bucket->dead) {
        return 0;   /* reset() (or the owner's death) retired it during the capture */
    }
    if (bucket->entries == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "nnscaler: cache bucket has no entry list");
        return -1;
    }
    if (entry->key != NULL) {
        PyErr_SetString(PyExc_ValueError, "nnscaler: a CacheEntry can be stored only once");
        return -1;
    }
    if (entry->shapes != NULL && entry->shapes->key_len != key->len) {
        PyErr_SetString(PyExc_ValueError,
                        "nnscaler: a dynamic entry's shape guards were made for another key");
        return -1;
    }
    unsigned char *data = PyMem_Malloc(key->len ? key->len : 1);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(data, key->data, key->len);
    PyObject **weak_pins = NULL;
    Py_ssize_t n_weak_pins = 0;
    if (key->pins != NULL && collect_weak_pins(key->pins, &weak_pins, &n_weak_pins) < 0) {
        PyMem_Free(data);
        return -1;
    }
    if (PyList_Insert(bucket->entries, 0, (PyObject *)entry) < 0) {
        PyMem_Free(weak_pins);
        PyMem_Free(data);
        return -1;
    }
    PyMem_Free(entry->weak_pins);
    entry->weak_pins = weak_pins;
    entry->n_weak_pins = n_weak_pins;
    entry->key = data;
    entry->key_len = key->len;
    entry->key_hash = call_key_hash(key);
    entry->pins = Py_XNewRef(key->pins);
    if (entry->runner != NULL) {
        bucket->captures++;
    }
    return 0;
}

/* ------------------------------------------------------- the bucket object */

static int
bucket_traverse(CacheBucket *self, visitproc visit, void *arg)
{
    Py_VISIT(self->self_ref);
    Py_VISIT(self->entries);
    Py_VISIT(self->dropped);
    Py_VISIT(self->eager_types);
    return 0;
}

static int
bucket_clear(CacheBucket *self)
{
    Py_CLEAR(self->self_ref);
    Py_CLEAR(self->entries);
    Py_CLEAR(self->dropped);
    Py_CLEAR(self->eager_types);
    return 0;
}

static void
bucket_dealloc(CacheBucket *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    bucket_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

void
cache_bucket_retire(CacheBucket *bucket)
{
    bucket->dead = 1;
    bucket->misses = bucket->fallbacks = bucket->captures = bucket->hits = 0;
    PyObject *entries = bucket->entries;
    bucket->entries = PyList_New(0);   /* NULL on memory error: lookups then treat it as empty */
    PyErr_Clear();
    Py_CLEAR(bucket->self_ref);
    Py_XDECREF(entries);               /* last: may run Python */
}

/* The weakref callback: `self` was collected, so its graphs (and the parameters
 * they hold) go now rather than at the next call of this code object. */
static PyObject *
bucket_on_self_collected(PyObject *bucket_obj, PyObject *Py_UNUSED(ref))
{
    CacheBucket *bucket = (CacheBucket *)Py_NewRef(bucket_obj);
    cache_bucket_retire(bucket);
    Py_DECREF(bucket);
    Py_RETURN_NONE;
}

static PyMethodDef bucket_callback_def = {
    "_on_self_collected", (PyCFunction)bucket_on_self_collected, METH_O, NULL,
};

static PyObject *
bucket_get_entries(CacheBucket *self, void *Py_UNUSED(closure))
{
    return self->entries ? PyList_GetSlice(self->entries, 0, PY_SSIZE_T_MAX) : PyList_New(0);
}

PyDoc_STRVAR(take_dropped_doc,
"take_dropped() -> list of str\n\nThe failing guard of each entry the lookup dropped as\n"
"stale since the last call (the recapture log names them), and forget them.");

static PyObject *
bucket_take_dropped(CacheBucket *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *dropped = self->dropped;
    self->dropped = NULL;
    return dropped != NULL ? dropped : PyList_New(0);
}

static PyMethodDef bucket_methods[] = {
    {"take_dropped", (PyCFunction)bucket_take_dropped, METH_NOARGS, take_dropped_doc},
    {NULL, NULL, 0, NULL},
};

static PyObject *
bucket_get_self(CacheBucket *self, void *Py_UNUSED(closure))
{
    if (self->self_ref == NULL) {
        Py_RETURN_NONE;
    }
    return Py_NewRef(nns_weakref_object(self->self_ref));
}

static PyObject *
bucket_get_eager_types(CacheBucket *self, void *Py_UNUSED(closure))
{
    return self->eager_types != NULL ? Py_NewRef(self->eager_types) : PyTuple_New(0);
}

static int
bucket_set_eager_types(CacheBucket *self, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL || !PyTuple_CheckExact(value)) {
        PyErr_SetString(PyExc_TypeError, "eager_types must be a tuple of (type, str) pairs");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(value); i++) {
        PyObject *pair = PyTuple_GET_ITEM(value, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyType_Check(PyTuple_GET_ITEM(pair, 0)) ||
            !PyUnicode_Check(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_Format(PyExc_TypeError, "eager_types[%zd] must be a (type, str) pair", i);
            return -1;
        }
    }
    Py_XSETREF(self->eager_types, PyTuple_GET_SIZE(value) ? Py_NewRef(value) : NULL);
    return 0;
}

static PyMemberDef bucket_members[] = {
    {"misses", T_PYSSIZET, offsetof(CacheBucket, misses), READONLY, "calls that found no valid entry"},
    {"fallbacks", T_PYSSIZET, offsetof(CacheBucket, fallbacks), 0, "calls run eagerly"},
    {"captures", T_PYSSIZET, offsetof(CacheBucket, captures), READONLY, "graphs captured"},
    {"hits", T_PYSSIZET, offsetof(CacheBucket, hits), READONLY, "calls served from the cache"},
    {"limit_warned", T_INT, offsetof(CacheBucket, limit_warned), 0, "cache_size_limit warning given"},
    {"dead", T_INT, offsetof(CacheBucket, dead), READONLY, "self was collected"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef bucket_getset[] = {
    {"entries", (getter)bucket_get_entries, NULL, "the entries, most recently used first", NULL},
    {"self", (getter)bucket_get_self, NULL, "the module (None for function targets or when collected)", NULL},
    {"eager_types", (getter)bucket_get_eager_types, (setter)bucket_set_eager_types,
     "(type, reason) pairs: calls with an argument of such a type run eagerly", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject CacheBucket_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.CacheBucket",
    .tp_basicsize = sizeof(CacheBucket),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The cache entries of one code object for one `self`.",
    .tp_weaklistoffset = offsetof(CacheBucket, weakreflist),
    .tp_dealloc = (destructor)bucket_dealloc,
    .tp_traverse = (traverseproc)bucket_traverse,
    .tp_clear = (inquiry)bucket_clear,
    .tp_members = bucket_members,
    .tp_methods = bucket_methods,
    .tp_getset = bucket_getset,
};

CacheBucket *
cache_bucket_new(PyObject *owner)
{
    CacheBucket *bucket = NULL;   /* owned */
    PyObject *callback = NULL;    /* owned */
    bucket = PyObject_GC_New(CacheBucket, &CacheBucket_Type);
    if (bucket == NULL) {
        return NULL;
    }
    bucket->self_ref = NULL;
    bucket->self_id = owner;
    bucket->dead = 0;
    bucket->misses = bucket->fallbacks = bucket->captures = bucket->hits = 0;
    bucket->limit_warned = 0;
    bucket->entries = PyList_New(0);
    bucket->dropped = NULL;
    bucket->eager_types = NULL;
    bucket->weakreflist = NULL;
    PyObject_GC_Track(bucket);
    if (bucket->entries == NULL) {
        goto error;
    }
    callback = PyCFunction_New(&bucket_callback_def, (PyObject *)bucket);
    if (callback == NULL) {
        goto error;
    }
    bucket->self_ref = PyWeakref_NewRef(owner, callback);
    if (bucket->self_ref == NULL) {
        goto error;
    }
    Py_DECREF(callback);
    return bucket;
error:
    Py_XDECREF(callback);
    Py_XDECREF(bucket);
    return NULL;
}
