/* cache.c - CacheEntry and CacheBucket. */
#include <stddef.h>
#include "cache.h"
#include "nns_globals.h"
#include "structmember.h"

/* ---------------------------------------------------------------- CacheEntry */

static int
entry_traverse(CacheEntry *self, visitproc visit, void *arg)
{
    Py_VISIT(self->runner);
    Py_VISIT(self->training_refs);
    for (Py_ssize_t i = 0; i < self->n_dicts; i++) {
        Py_VISIT(self->dicts[i]);
    }
    for (Py_ssize_t i = 0; i < self->n_flags; i++) {
        Py_VISIT(self->flag_refs[i]);
    }
    Py_VISIT(self->guard_names);
    Py_VISIT(self->info);
    Py_VISIT(self->pins);
    return 0;
}

static int
entry_clear(CacheEntry *self)
{
    Py_CLEAR(self->runner);
    Py_CLEAR(self->training_refs);
    for (Py_ssize_t i = 0; i < self->n_dicts; i++) {
        Py_CLEAR(self->dicts[i]);
    }
    for (Py_ssize_t i = 0; i < self->n_flags; i++) {
        Py_CLEAR(self->flag_refs[i]);
    }
    Py_CLEAR(self->guard_names);
    Py_CLEAR(self->info);
    Py_CLEAR(self->pins);
    return 0;
}

static void
entry_dealloc(CacheEntry *self)
{
    PyObject_GC_UnTrack(self);
    entry_clear(self);
    PyMem_Free(self->dicts);
    PyMem_Free(self->versions);
    PyMem_Free(self->flag_refs);
    PyMem_Free(self->flag_values);
    PyMem_Free(self->key);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
weakref_tuple(PyObject *modules, const char *what)
{
    PyObject *seq = PySequence_Fast(modules, what);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *refs = PyTuple_New(n);
    for (Py_ssize_t i = 0; refs != NULL && i < n; i++) {
        PyObject *ref = PyWeakref_NewRef(PySequence_Fast_GET_ITEM(seq, i), NULL);
        if (ref == NULL) {
            Py_CLEAR(refs);
            break;
        }
        PyTuple_SET_ITEM(refs, i, ref);
    }
    Py_DECREF(seq);
    return refs;
}

PyDoc_STRVAR(entry_doc,
"CacheEntry(runner, training_modules, dict_guards, flag_guards, guard_names, info)\n\n"
"One captured graph and its guards.  `runner` is called as runner(*slots, *flags)\n"
"on a hit (None: run the frame eagerly).  `training_modules` give the flags passed\n"
"to the runner.  `dict_guards` are dicts whose version is snapshotted now; any\n"
"change makes the entry stale.  `flag_guards` are (module, bool) pairs compared by\n"
"value.  `guard_names` describe the guards, dict guards first.");

static PyObject *
entry_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"runner", "training_modules", "dict_guards", "flag_guards",
                             "guard_names", "info", NULL};
    PyObject *runner, *training_modules, *dict_guards, *flag_guards, *guard_names, *info;
    PyObject *dicts_seq = NULL, *flags_seq = NULL;   /* owned */
    CacheEntry *self = NULL;                          /* owned */

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOO:CacheEntry", kwlist, &runner,
                                     &training_modules, &dict_guards, &flag_guards,
                                     &guard_names, &info)) {
        return NULL;
    }
    if (runner != Py_None && !PyCallable_Check(runner)) {
        PyErr_Format(PyExc_TypeError, "CacheEntry: runner must be callable or None, not %.100s",
                     Py_TYPE(runner)->tp_name);
        return NULL;
    }
    self = (CacheEntry *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->runner = runner == Py_None ? NULL : Py_NewRef(runner);
    self->info = Py_NewRef(info);
    if ((self->training_refs = weakref_tuple(training_modules, "training_modules must be a sequence")) == NULL) {
        goto error;
    }
    if ((dicts_seq = PySequence_Fast(dict_guards, "dict_guards must be a sequence")) == NULL ||
        (flags_seq = PySequence_Fast(flag_guards, "flag_guards must be a sequence")) == NULL) {
        goto error;
    }
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(dicts_seq);
    Py_ssize_t nf = PySequence_Fast_GET_SIZE(flags_seq);
    self->dicts = PyMem_Calloc((size_t)nd + 1, sizeof(PyObject *));
    self->versions = PyMem_Calloc((size_t)nd + 1, sizeof(uint64_t));
    self->flag_refs = PyMem_Calloc((size_t)nf + 1, sizeof(PyObject *));
    self->flag_values = PyMem_Calloc((size_t)nf + 1, 1);
    if (!self->dicts || !self->versions || !self->flag_refs || !self->flag_values) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *d = PySequence_Fast_GET_ITEM(dicts_seq, i);
        if (!PyDict_Check(d)) {
            PyErr_Format(PyExc_TypeError, "CacheEntry: dict_guards[%zd] is a %.100s, not a dict",
                         i, Py_TYPE(d)->tp_name);
            goto error;
        }
        self->dicts[i] = Py_NewRef(d);
        self->versions[i] = nns_dict_version(d);
        self->n_dicts = i + 1;
    }
    for (Py_ssize_t i = 0; i < nf; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(flags_seq, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "CacheEntry: flag_guards[%zd] must be (module, bool)", i);
            goto error;
        }
        int value = PyObject_IsTrue(PyTuple_GET_ITEM(pair, 1));
        if (value < 0) {
            goto error;
        }
        PyObject *ref = PyWeakref_NewRef(PyTuple_GET_ITEM(pair, 0), NULL);
        if (ref == NULL) {
            goto error;
        }
        self->flag_refs[i] = ref;
        self->flag_values[i] = (char)value;
        self->n_flags = i + 1;
    }
    if ((self->guard_names = PySequence_Tuple(guard_names)) == NULL) {
        goto error;
    }
    if (PyTuple_GET_SIZE(self->guard_names) != nd + nf) {
        PyErr_Format(PyExc_ValueError, "CacheEntry: %zd guard_names for %zd guards",
                     PyTuple_GET_SIZE(self->guard_names), nd + nf);
        goto error;
    }
    Py_DECREF(dicts_seq);
    Py_DECREF(flags_seq);
    return (PyObject *)self;
error:
    Py_XDECREF(dicts_seq);
    Py_XDECREF(flags_seq);
    Py_XDECREF(self);
    return NULL;
}

PyObject *
cache_read_training(PyObject *module)
{
    PyObject *flag = PyObject_GetAttr(module, nns_globals.str_training);
    if (flag == NULL) {
        return NULL;
    }
    int truth = (flag == Py_True) ? 1 : (flag == Py_False) ? 0 : PyObject_IsTrue(flag);
    Py_DECREF(flag);
    if (truth < 0) {
        return NULL;
    }
    return truth ? Py_True : Py_False;
}

int
cache_entry_check(CacheEntry *entry, Py_ssize_t *failed)
{
    for (Py_ssize_t i = 0; i < entry->n_dicts; i++) {
        if (nns_dict_version(entry->dicts[i]) != entry->versions[i]) {
            *failed = i;
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < entry->n_flags; i++) {
        PyObject *module = nns_weakref_object(entry->flag_refs[i]);
        if (module == Py_None) {
            *failed = entry->n_dicts + i;
            return -1;
        }
        PyObject *flag = cache_read_training(module);
        if (flag == NULL) {
            PyErr_Clear();
            *failed = entry->n_dicts + i;
            return 0;
        }
        if ((flag == Py_True) != (entry->flag_values[i] != 0)) {
            *failed = entry->n_dicts + i;
            return 0;
        }
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(entry->training_refs); i++) {
        if (nns_weakref_object(PyTuple_GET_ITEM(entry->training_refs, i)) == Py_None) {
            *failed = -1;
            return -1;
        }
    }
    return 1;
}

PyDoc_STRVAR(check_verbose_doc,
"check_verbose() -> None or str\n\nNone when every state guard holds, else the name of\n"
"the first failing one (for logs; the hit path uses the C check).");

static PyObject *
entry_check_verbose(CacheEntry *self, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t failed = -1;
    int ok = cache_entry_check(self, &failed);
    if (ok == 1) {
        Py_RETURN_NONE;
    }
    if (failed < 0 || failed >= PyTuple_GET_SIZE(self->guard_names)) {
        return PyUnicode_FromString("a module whose training flag feeds the graph was collected");
    }
    return Py_NewRef(PyTuple_GET_ITEM(self->guard_names, failed));
}

static PyObject *
entry_get_runner(CacheEntry *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->runner ? self->runner : Py_None);
}

static PyObject *
entry_get_key_hash(CacheEntry *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(self->key_hash);
}

static PyObject *
entry_get_n_guards(CacheEntry *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->n_dicts + self->n_flags);
}

static PyMethodDef entry_methods[] = {
    {"check_verbose", (PyCFunction)entry_check_verbose, METH_NOARGS, check_verbose_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef entry_members[] = {
    {"info", T_OBJECT, offsetof(CacheEntry, info), READONLY, "Python-side description"},
    {"hits", T_PYSSIZET, offsetof(CacheEntry, hits), READONLY, "calls served"},
    {"guard_names", T_OBJECT, offsetof(CacheEntry, guard_names), READONLY, "state guards"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef entry_getset[] = {
    {"runner", (getter)entry_get_runner, NULL, "the callable run on a hit, or None", NULL},
    {"key_hash", (getter)entry_get_key_hash, NULL, "XXH3 hash of the call key", NULL},
    {"n_state_guards", (getter)entry_get_n_guards, NULL, "number of state guards", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject CacheEntry_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.CacheEntry",
    .tp_basicsize = sizeof(CacheEntry),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = entry_doc,
    .tp_new = entry_new,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_traverse = (traverseproc)entry_traverse,
    .tp_clear = (inquiry)entry_clear,
    .tp_methods = entry_methods,
    .tp_members = entry_members,
    .tp_getset = entry_getset,
};

/* --------------------------------------------------------------- CacheBucket */

static int
bucket_traverse(CacheBucket *self, visitproc visit, void *arg)
{
    Py_VISIT(self->self_ref);
    Py_VISIT(self->entries);
    return 0;
}

static int
bucket_clear(CacheBucket *self)
{
    Py_CLEAR(self->self_ref);
    Py_CLEAR(self->entries);
    return 0;
}

static void
bucket_dealloc(CacheBucket *self)
{
    PyObject_GC_UnTrack(self);
    bucket_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The weakref callback: `self` was collected, so its graphs (and the parameters
 * they hold) go now rather than at the next call of this code object. */
static PyObject *
bucket_on_self_collected(PyObject *bucket_obj, PyObject *Py_UNUSED(ref))
{
    CacheBucket *bucket = (CacheBucket *)bucket_obj;
    bucket->dead = 1;
    PyObject *entries = bucket->entries;
    bucket->entries = PyList_New(0);   /* NULL on memory error: lookups then treat it as empty */
    Py_XDECREF(entries);
    Py_CLEAR(bucket->self_ref);
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

static PyObject *
bucket_get_self(CacheBucket *self, void *Py_UNUSED(closure))
{
    if (self->self_ref == NULL) {
        Py_RETURN_NONE;
    }
    return Py_NewRef(nns_weakref_object(self->self_ref));
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
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject CacheBucket_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.CacheBucket",
    .tp_basicsize = sizeof(CacheBucket),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The cache entries of one code object for one `self`.",
    .tp_dealloc = (destructor)bucket_dealloc,
    .tp_traverse = (traverseproc)bucket_traverse,
    .tp_clear = (inquiry)bucket_clear,
    .tp_members = bucket_members,
    .tp_getset = bucket_getset,
};

CacheBucket *
cache_find_bucket(PyObject *buckets, PyObject *self)
{
    if (buckets == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(buckets); i++) {
        CacheBucket *b = (CacheBucket *)PyList_GET_ITEM(buckets, i);
        if (b->dead) {
            /* Pruning cannot fail: deleting one item shrinks the list. */
            if (PySequence_DelItem(buckets, i) < 0) {
                PyErr_Clear();
                return NULL;
            }
            i--;
            continue;
        }
        if (b->self_id == (void *)self) {
            return b;
        }
    }
    return NULL;
}

CacheBucket *
cache_new_bucket(PyObject **buckets, PyObject *self)
{
    CacheBucket *bucket = NULL;   /* owned */
    PyObject *callback = NULL;    /* owned */
    if (*buckets == NULL && (*buckets = PyList_New(0)) == NULL) {
        return NULL;
    }
    bucket = PyObject_GC_New(CacheBucket, &CacheBucket_Type);
    if (bucket == NULL) {
        return NULL;
    }
    bucket->self_ref = NULL;
    bucket->self_id = self;
    bucket->dead = 0;
    bucket->misses = bucket->fallbacks = bucket->captures = bucket->hits = 0;
    bucket->limit_warned = 0;
    bucket->entries = PyList_New(0);
    PyObject_GC_Track(bucket);
    if (bucket->entries == NULL) {
        goto error;
    }
    if (self != NULL) {
        callback = PyCFunction_New(&bucket_callback_def, (PyObject *)bucket);
        if (callback == NULL) {
            goto error;
        }
        bucket->self_ref = PyWeakref_NewRef(self, callback);
        if (bucket->self_ref == NULL) {
            goto error;
        }
    }
    if (PyList_Append(*buckets, (PyObject *)bucket) < 0) {
        goto error;
    }
    Py_XDECREF(callback);
    Py_DECREF(bucket);   /* the list owns it now */
    return bucket;
error:
    Py_XDECREF(callback);
    Py_XDECREF(bucket);
    return NULL;
}

static inline int
key_equal(const CacheEntry *e, const CallKey *key)
{
    return e->key_hash == key->hash && e->key_len == key->len &&
           memcmp(e->key, key->data, key->len) == 0;
}

CacheEntry *
cache_lookup(CacheBucket *bucket, const CallKey *key)
{
    PyObject *entries = bucket->entries;
    if (entries == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries); i++) {
        CacheEntry *e = (CacheEntry *)PyList_GET_ITEM(entries, i);
        if (!key_equal(e, key)) {
            continue;
        }
        Py_ssize_t failed;
        int ok = cache_entry_check(e, &failed);
        if (ok == 1) {
            if (i > 0) {
                /* Most recently used first: a steady workload hits at index 0. The
                 * list keeps its own reference throughout the swap. */
                PyObject *first = PyList_GET_ITEM(entries, 0);
                PyList_SET_ITEM(entries, 0, (PyObject *)e);
                PyList_SET_ITEM(entries, i, first);
            }
            return e;
        }
        if (ok < 0) {
            /* Stale for good (a guarded dict changed). Removing cannot run Python
             * code that reaches this list: entries hold no finalizers. */
            if (PySequence_DelItem(entries, i) < 0) {
                PyErr_Clear();
                return NULL;
            }
            i--;
        }
    }
    return NULL;
}

int
cache_insert(CacheBucket *bucket, CacheEntry *entry, CallKey *key)
{
    if (bucket->entries == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "nnscaler: cache bucket has no entry list");
        return -1;
    }
    if (entry->key != NULL) {
        PyErr_SetString(PyExc_ValueError, "nnscaler: a CacheEntry can be stored only once");
        return -1;
    }
    unsigned char *data = PyMem_Malloc(key->len ? key->len : 1);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(data, key->data, key->len);
    if (PyList_Insert(bucket->entries, 0, (PyObject *)entry) < 0) {
        PyMem_Free(data);
        return -1;
    }
    entry->key = data;
    entry->key_len = key->len;
    entry->key_hash = key->hash;
    entry->pins = key->pins;     /* moved */
    key->pins = NULL;
    if (entry->runner != NULL) {
        bucket->captures++;
    }
    return 0;
}
