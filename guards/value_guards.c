/* value_guards.c - guards on the Python values a capture read (see value_guards.h). */
#include "value_guards.h"
#include "structmember.h"

static const char *const kind_names[] = {"dict", "list", "cell", "function", "tensor", "call",
                                         "tensors", "bytes", "slots"};

/* A dict key whose hashing and comparing run no Python: exact str, int, float, bool,
 * None, bytes, and exact tuples of them. */
static int
is_plain_key(PyObject *key, int depth)
{
    PyTypeObject *type = Py_TYPE(key);
    if (type == &PyUnicode_Type || type == &PyLong_Type || type == &PyFloat_Type ||
        type == &PyBool_Type || type == &PyBytes_Type || key == Py_None) {
        return 1;
    }
    if (type != &PyTuple_Type || depth > 4) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(key); i++) {
        if (!is_plain_key(PyTuple_GET_ITEM(key, i), depth + 1)) {
            return 0;
        }
    }
    return 1;
}

/* Equal as far as a captured graph can tell: identity, or value for immutable
 * scalars and tuples of them.  No Python code runs for these types. */
static int
same_value(PyObject *a, PyObject *b)
{
    if (a == b) {
        return 1;
    }
    PyTypeObject *type = Py_TYPE(a);
    if (type != Py_TYPE(b)) {
        return 0;
    }
    if (type == &PyLong_Type || type == &PyFloat_Type || type == &PyComplex_Type ||
        type == &PyUnicode_Type || type == &PyBytes_Type ||
        strcmp(type->tp_name, "torch.device") == 0) {
        int eq = PyObject_RichCompareBool(a, b, Py_EQ);
        if (eq < 0) {
            PyErr_Clear();
            return 0;
        }
        return eq;
    }
    if (PyTuple_Check(a)) {   /* tuples, torch.Size, named tuples: immutable */
        Py_ssize_t n = PyTuple_GET_SIZE(a);
        if (n != PyTuple_GET_SIZE(b)) {
            return 0;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!same_value(PyTuple_GET_ITEM(a, i), PyTuple_GET_ITEM(b, i))) {
                return 0;
            }
        }
        return 1;
    }
    return 0;
}

/* A new tuple with the items of `tuple` (PyTuple_GetSlice of a whole tuple returns the
 * same object, and hold_weakly replaces items in place). */
static PyObject *
own_copy(PyObject *tuple)
{
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    PyObject *copy = PyTuple_New(n);
    for (Py_ssize_t i = 0; copy != NULL && i < n; i++) {
        PyTuple_SET_ITEM(copy, i, Py_NewRef(PyTuple_GET_ITEM(tuple, i)));
    }
    return copy;
}

/* Expected values that would keep an object graph alive are held by weakref.
 * Values compared by value (and tuples of them) stay strong: they reference nothing
 * that can lead back to a module. */
static int
hold_weakly(ValueGuard *guard)
{
    PyObject *expected = guard->expected;
    Py_ssize_t n = PyTuple_GET_SIZE(expected);
    guard->weak = PyMem_Calloc((size_t)n + 1, 1);
    if (guard->weak == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(expected, i);
        if (item == guard->missing || !PyType_SUPPORTS_WEAKREFS(Py_TYPE(item))) {
            continue;
        }
        PyObject *ref = PyWeakref_NewRef(item, NULL);
        if (ref == NULL) {
            PyErr_Clear();   /* weakref refused (a type that opts out): keep it strong */
            continue;
        }
        PyTuple_SET_ITEM(expected, i, ref);   /* the tuple is ours alone (made below) */
        Py_DECREF(item);
        guard->weak[i] = 1;
    }
    return 0;
}

/* The expected item `i`, borrowed; NULL when it was held weakly and died. */
static inline PyObject *
expected_item(ValueGuard *guard, Py_ssize_t i)
{
    PyObject *item = PyTuple_GET_ITEM(guard->expected, i);
    if (guard->weak != NULL && guard->weak[i]) {
        item = nns_weakref_object(item);
        return item == Py_None ? NULL : item;
    }
    return item;
}

PyObject *
value_guard_expected(ValueGuard *guard, Py_ssize_t i)
{
    return expected_item(guard, i);
}

static int
spec_error(Py_ssize_t size, const char *kind, const char *what)
{
    PyErr_Format(PyExc_TypeError, "value guard spec (%zd items, kind %s): %s", size, kind, what);
    return -1;
}

/* ---- VG_BYTES: a buffer's layout and contents ---- */

#define BUFFER_FLAGS PyBUF_RECORDS_RO   /* shape, strides and format; read-only is enough */

/* The layout words of `view`: ndim, itemsize, len, then shape and strides.  Returns
 * how many words were written into `words` (at most 3 + 2 * PyBUF_MAX_NDIM). */
static Py_ssize_t
buffer_layout(const Py_buffer *view, Py_ssize_t *words)
{
    Py_ssize_t n = 0;
    words[n++] = view->ndim;
    words[n++] = view->itemsize;
    words[n++] = view->len;
    for (int d = 0; d < view->ndim; d++) {
        words[n++] = view->shape != NULL ? view->shape[d] : view->len / view->itemsize;
        words[n++] = view->strides != NULL ? view->strides[d] : view->itemsize;
    }
    return n;
}

static const char *
buffer_format(const Py_buffer *view)
{
    return view->format != NULL ? view->format : "B";
}

/* The buffer's bytes in C order: `view->buf` itself when contiguous, else a copy in
 * `*scratch` (PyMem, the caller frees it).  NULL with MemoryError set. */
static const char *
buffer_bytes(Py_buffer *view, char **scratch)
{
    *scratch = NULL;
    if (PyBuffer_IsContiguous(view, 'C')) {
        return view->buf;
    }
    *scratch = PyMem_Malloc(view->len > 0 ? (size_t)view->len : 1);
    if (*scratch == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (PyBuffer_ToContiguous(*scratch, view, view->len, 'C') < 0) {
        PyMem_Free(*scratch);
        *scratch = NULL;
        return NULL;
    }
    return *scratch;
}

/* (layout bytes: the words then the format, contents bytes) of `obj`, new, or NULL
 * with an exception set. */
static PyObject *
buffer_snapshot(PyObject *obj)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, BUFFER_FLAGS) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (strchr(buffer_format(&view), 'O') != NULL) {
        PyErr_SetString(PyExc_TypeError, "value guard spec (bytes): a buffer of objects "
                                         "cannot be compared by its bytes");
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t words[3 + 2 * PyBUF_MAX_NDIM];
    Py_ssize_t nwords = buffer_layout(&view, words);
    const char *format = buffer_format(&view);
    size_t format_len = strlen(format);
    size_t layout_len = (size_t)nwords * sizeof(Py_ssize_t);
    PyObject *layout = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(layout_len + format_len));
    char *scratch = NULL;
    const char *data = layout != NULL ? buffer_bytes(&view, &scratch) : NULL;
    if (data != NULL) {
        memcpy(PyBytes_AS_STRING(layout), words, layout_len);
        memcpy(PyBytes_AS_STRING(layout) + layout_len, format, format_len);
        PyObject *contents = PyBytes_FromStringAndSize(data, view.len);
        if (contents != NULL) {
            result = PyTuple_Pack(2, layout, contents);
            Py_DECREF(contents);
        }
    }
    PyMem_Free(scratch);
    Py_XDECREF(layout);
    PyBuffer_Release(&view);
    return result;
}

/* Runs Python only for an exporter written in Python (3.12+ `__buffer__`; the
 * Python side picks C exporters): the object and the snapshot are held across the
 * call, so a `__buffer__` that clears this guard (a reset) leaves both readable. */
static int
check_bytes(ValueGuard *guard)
{
    PyObject *expected = Py_NewRef(guard->expected);
    PyObject *target = Py_NewRef(guard->target);
    PyObject *layout = PyTuple_GET_ITEM(expected, 0);
    PyObject *contents = PyTuple_GET_ITEM(expected, 1);
    Py_buffer view;
    if (PyObject_GetBuffer(target, &view, BUFFER_FLAGS) < 0) {
        PyErr_Clear();   /* no longer exports a buffer: does not hold */
        Py_DECREF(target);
        Py_DECREF(expected);
        return 0;
    }
    Py_ssize_t words[3 + 2 * PyBUF_MAX_NDIM];
    size_t layout_len = (size_t)buffer_layout(&view, words) * sizeof(Py_ssize_t);
    const char *format = buffer_format(&view);
    size_t format_len = strlen(format);
    int ok = (size_t)PyBytes_GET_SIZE(layout) == layout_len + format_len &&
             memcmp(PyBytes_AS_STRING(layout), words, layout_len) == 0 &&
             memcmp(PyBytes_AS_STRING(layout) + layout_len, format, format_len) == 0 &&
             PyBytes_GET_SIZE(contents) == view.len;
    if (ok) {
        char *scratch = NULL;
        const char *data = buffer_bytes(&view, &scratch);
        if (data == NULL) {
            PyErr_Clear();
            ok = 0;
        }
        else {
            ok = memcmp(data, PyBytes_AS_STRING(contents), (size_t)view.len) == 0;
        }
        PyMem_Free(scratch);
    }
    PyBuffer_Release(&view);
    Py_DECREF(target);
    Py_DECREF(expected);
    return ok;
}

/* ---- VG_SLOTS: attributes in __slots__ ---- */

/* Where the object slot `name` of `tp` lives, or -1 with a TypeError: a member
 * descriptor found along the MRO, holding an object. */
static Py_ssize_t
slot_offset(PyTypeObject *tp, PyObject *name)
{
    PyObject *descr = nns_type_lookup(tp, name);
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "value guard spec (slots): %R is not a slot of %s",
                     name, tp->tp_name);
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || member->offset <= 0) {
        PyErr_Format(PyExc_TypeError, "value guard spec (slots): %R of %s does not hold "
                                      "an object", name, tp->tp_name);
        return -1;
    }
    return member->offset;
}

static int
check_slots(ValueGuard *guard)
{
    PyObject *obj = guard->target;
    if (Py_TYPE(obj) != guard->owner_type) {
        return 0;   /* `obj.__class__ = ...`: other slots (or the same, elsewhere) */
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(guard->expected); i++) {
        PyObject *value = *(PyObject **)((char *)obj + guard->slot_offsets[i]);
        PyObject *want = expected_item(guard, i);
        if (want == NULL) {
            return 0;
        }
        if (value == NULL ? want != guard->missing : !same_value(want, value)) {
            return 0;
        }
    }
    return 1;
}

int
value_guard_init(ValueGuard *guard, PyObject *spec)
{
    memset(guard, 0, sizeof(*guard));
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 2) {
        PyErr_SetString(PyExc_TypeError, "value guard spec must be a tuple (kind, target, ...)");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(spec);
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(spec, 0));
    if (kind == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (kind < VG_DICT || kind > VG_SLOTS) {
        PyErr_Format(PyExc_ValueError, "value guard spec: unknown kind %ld", kind);
        return -1;
    }
    const char *name = kind_names[kind];
    PyObject *target = PyTuple_GET_ITEM(spec, 1);
    guard->kind = (int)kind;
    switch (kind) {
    case VG_DICT: {
        if (n < 5 || n > 7 || !PyDict_Check(target) || !PyTuple_Check(PyTuple_GET_ITEM(spec, 2)) ||
            !PyTuple_Check(PyTuple_GET_ITEM(spec, 3)) ||
            PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 2)) != PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 3))) {
            return spec_error(n, name, "expected (0, dict, keys tuple, values tuple of the same length, missing[, owner[, watched frozenset]])");
        }
        if (n == 7 && PyTuple_GET_ITEM(spec, 6) == Py_True) {
            guard->exact = 1;
        }
        else if (n == 7 && PyTuple_GET_ITEM(spec, 6) != Py_None) {
            if (!PyFrozenSet_Check(PyTuple_GET_ITEM(spec, 6))) {
                return spec_error(n, name, "watched must be a frozenset of names, True or None");
            }
            guard->watched = Py_NewRef(PyTuple_GET_ITEM(spec, 6));
        }
        guard->keys = Py_NewRef(PyTuple_GET_ITEM(spec, 2));
        guard->missing = Py_NewRef(PyTuple_GET_ITEM(spec, 4));
        if ((guard->expected = own_copy(PyTuple_GET_ITEM(spec, 3))) == NULL ||
            hold_weakly(guard) < 0) {
            return -1;
        }
        guard->dict = target;
        guard->version = nns_dict_version(target);
        if (n >= 6 && PyTuple_GET_ITEM(spec, 5) != Py_None) {
            PyObject *owner = PyTuple_GET_ITEM(spec, 5);
            PyObject *owned_dict = PyObject_GenericGetDict(owner, NULL);
            PyObject *ref = NULL;
            if (owned_dict == target) {
                ref = PyWeakref_NewRef(owner, NULL);
            }
            Py_XDECREF(owned_dict);
            if (ref != NULL) {
                /* the guard holds the owner weakly and the dict not at all */
                guard->target = ref;
                guard->owner_type = (PyTypeObject *)Py_NewRef(Py_TYPE(owner));
                guard->dict_offset = nns_object_dict_offset(owner);
                return 0;
            }
            /* not the owner's plain __dict__, or not weakly referenceable: hold
             * the dict itself, as for owner-less dicts */
            PyErr_Clear();
        }
        break;
    }
    case VG_LIST:
        if (n != 3 || !PyList_Check(target) || !PyTuple_Check(PyTuple_GET_ITEM(spec, 2))) {
            return spec_error(n, name, "expected (1, list, items tuple)");
        }
        if ((guard->expected = own_copy(PyTuple_GET_ITEM(spec, 2))) == NULL ||
            hold_weakly(guard) < 0) {
            return -1;
        }
        break;
    case VG_CELL:
        if (n != 3 || !PyCell_Check(target)) {
            return spec_error(n, name, "expected (2, cell, value)");
        }
        guard->expected = PyTuple_Pack(1, PyTuple_GET_ITEM(spec, 2));
        if (guard->expected == NULL || hold_weakly(guard) < 0) {
            return -1;
        }
        break;
    case VG_FUNCTION:
        if (n != 5 || !PyFunction_Check(target)) {
            return spec_error(n, name, "expected (3, function, code, defaults, kwdefaults)");
        }
        guard->expected = PyTuple_GetSlice(spec, 2, 5);
        if (guard->expected == NULL) {
            return -1;
        }
        break;
    case VG_TENSOR:
        if (n != 5 || !PyWeakref_CheckRef(target)) {
            return spec_error(n, name, "expected (4, weakref to tensor, dtype, device, shape)");
        }
        guard->expected = PyTuple_GetSlice(spec, 2, 5);
        if (guard->expected == NULL) {
            return -1;
        }
        break;
    case VG_CALL:
        if (n != 2 || !PyCallable_Check(target)) {
            return spec_error(n, name, "expected (5, callable)");
        }
        break;
    case VG_TENSORS: {
        PyObject *refs = n == 4 ? PyTuple_GET_ITEM(spec, 2) : NULL;
        PyObject *metas = n == 4 ? PyTuple_GET_ITEM(spec, 3) : NULL;
        if (n != 4 || !PyDict_Check(target) || !PyTuple_Check(refs) || !PyTuple_Check(metas) ||
            PyTuple_GET_SIZE(refs) != PyTuple_GET_SIZE(metas)) {
            return spec_error(n, name, "expected (6, epoch dict, weakrefs tuple, metadata tuple of the same length)");
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(refs); i++) {
            PyObject *meta = PyTuple_GET_ITEM(metas, i);
            if (!PyWeakref_CheckRef(PyTuple_GET_ITEM(refs, i)) || !PyTuple_Check(meta) ||
                PyTuple_GET_SIZE(meta) != 3) {
                return spec_error(n, name, "each tensor: a weakref and (dtype, device, shape)");
            }
        }
        guard->keys = Py_NewRef(refs);
        guard->expected = Py_NewRef(metas);
        guard->dict = target;
        guard->version = nns_dict_version(target);
        break;
    }
    case VG_BYTES:
        if (n != 2 || !PyObject_CheckBuffer(target)) {
            return spec_error(n, name, "expected (7, object exporting a buffer)");
        }
        if ((guard->expected = buffer_snapshot(target)) == NULL) {
            return -1;
        }
        break;
    case VG_SLOTS: {
        PyObject *names = n == 5 ? PyTuple_GET_ITEM(spec, 2) : NULL;
        PyObject *values = n == 5 ? PyTuple_GET_ITEM(spec, 3) : NULL;
        if (n != 5 || !PyTuple_Check(names) || !PyTuple_Check(values) ||
            PyTuple_GET_SIZE(names) != PyTuple_GET_SIZE(values)) {
            return spec_error(n, name, "expected (8, object, names tuple, values tuple of the same length, missing)");
        }
        Py_ssize_t count = PyTuple_GET_SIZE(names);
        guard->slot_offsets = PyMem_Calloc((size_t)count + 1, sizeof(Py_ssize_t));
        if (guard->slot_offsets == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < count; i++) {
            if (!PyUnicode_Check(PyTuple_GET_ITEM(names, i))) {
                return spec_error(n, name, "slot names must be str");
            }
            if ((guard->slot_offsets[i] = slot_offset(Py_TYPE(target), PyTuple_GET_ITEM(names, i))) < 0) {
                return -1;
            }
        }
        guard->keys = Py_NewRef(names);
        guard->missing = Py_NewRef(PyTuple_GET_ITEM(spec, 4));
        guard->owner_type = (PyTypeObject *)Py_NewRef(Py_TYPE(target));
        if ((guard->expected = own_copy(values)) == NULL || hold_weakly(guard) < 0) {
            return -1;
        }
        break;
    }
    }
    guard->target = Py_NewRef(target);
    return 0;
}

void
value_guard_clear(ValueGuard *guard)
{
    Py_CLEAR(guard->target);
    Py_CLEAR(guard->keys);
    Py_CLEAR(guard->expected);
    Py_CLEAR(guard->missing);
    Py_CLEAR(guard->watched);
    Py_CLEAR(guard->owner_type);
    PyMem_Free(guard->weak);
    guard->weak = NULL;
    if (guard->kind == VG_SLOTS) {
        PyMem_Free(guard->slot_offsets);   /* shares its field with `dict` */
    }
    guard->dict = NULL;
}

int
value_guard_traverse(ValueGuard *guard, visitproc visit, void *arg)
{
    Py_VISIT(guard->target);
    Py_VISIT(guard->keys);
    Py_VISIT(guard->expected);
    Py_VISIT(guard->missing);
    Py_VISIT(guard->watched);
    Py_VISIT(guard->owner_type);
    return 0;
}

/* The guarded dict, owned; NULL when its owner died (*stale set), changed class or
 * replaced it. */
static PyObject *
guarded_dict(ValueGuard *guard, int *stale)
{
    *stale = 0;
    if (guard->target == guard->dict) {
        return Py_NewRef(guard->dict);
    }
    PyObject *owner = nns_weakref_object(guard->target);
    if (owner == Py_None) {
        *stale = 1;
        return NULL;
    }
    if (Py_TYPE(owner) != guard->owner_type) {
        return NULL;   /* `obj.__class__ = ...`: not stale, the class may come back */
    }
    /* The owner's current __dict__: the guarded one unless `obj.__dict__ = ...`
     * replaced it (then the old dict may be gone: compared by address only). */
    PyObject *dict = PyObject_GenericGetDict(owner, NULL);
    if (dict == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (dict != guard->dict) {
        Py_DECREF(dict);
        return NULL;
    }
    return dict;
}

/* How many of the dict's keys are watched names (a re-validation only).  Walks an
 * owned copy of the keys: hashing a non-str key may run Python. */
static Py_ssize_t
watched_count(PyObject *dict, PyObject *watched)
{
    PyObject *keys = PyDict_Keys(dict);
    if (keys == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyUnicode_CheckExact(key)) {
            continue;   /* watched names are str */
        }
        int in = PySet_Contains(watched, key);
        if (in < 0) {
            PyErr_Clear();
            count = -1;
            break;
        }
        count += in;
    }
    Py_DECREF(keys);
    return count;
}

static int
check_dict(ValueGuard *guard)
{
    int stale;
    PyObject *dict = guarded_dict(guard, &stale);   /* owned */
    if (dict == NULL) {
        return stale ? -1 : 0;
    }
    int ok = 1;
    uint64_t version = nns_dict_version(dict);
    if (version == guard->version) {
        goto done;
    }
    /* Re-validate the recorded entries (plain keys only: no Python runs in the
     * lookups).  Values are held as owned references all the same. */
    Py_ssize_t n = PyTuple_GET_SIZE(guard->keys);
    if (guard->exact && PyDict_GET_SIZE(dict) != n) {
        ok = 0;
    }
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(guard->keys, i);
        if (!is_plain_key(key, 0)) {
            /* Looking it up would run its __eq__/__hash__, which may rewrite this dict
             * on every comparison (CPython's lookup then restarts forever): a moved
             * dict with such a key simply does not hold. */
            ok = 0;
            break;
        }
        PyObject *value = PyDict_GetItemWithError(dict, key);
        if (value == NULL) {
            if (PyErr_Occurred()) {
                PyErr_Clear();
                ok = 0;
                break;
            }
            value = guard->missing;
        }
        Py_INCREF(value);
        PyObject *want = expected_item(guard, i);
        ok = want != NULL && same_value(want, value);
        Py_DECREF(value);
    }
    if (ok && guard->watched != NULL) {
        ok = watched_count(dict, guard->watched) == n;
    }
    if (ok) {
        /* Everything the capture read is as it was: remember the version read before
         * the comparisons, so a write made meanwhile is looked at again next time. */
        guard->version = version;
    }
done:
    Py_DECREF(dict);
    return ok;
}

static int
check_list(ValueGuard *guard)
{
    PyObject *list = guard->target;
    PyObject *expected = guard->expected;
    Py_ssize_t n = PyTuple_GET_SIZE(expected);
    if (PyList_GET_SIZE(list) != n) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* same_value runs no Python for the types it compares by value */
        PyObject *want = expected_item(guard, i);
        if (want == NULL || !same_value(want, PyList_GET_ITEM(list, i))) {
            return 0;
        }
    }
    return 1;
}

static int
check_function(ValueGuard *guard)
{
    PyObject *fn = guard->target;
    PyObject *expected = guard->expected;
    PyObject *defaults = PyFunction_GET_DEFAULTS(fn);
    PyObject *kwdefaults = PyFunction_GET_KW_DEFAULTS(fn);
    return PyFunction_GET_CODE(fn) == PyTuple_GET_ITEM(expected, 0) &&
           (defaults ? defaults : Py_None) == PyTuple_GET_ITEM(expected, 1) &&
           (kwdefaults ? kwdefaults : Py_None) == PyTuple_GET_ITEM(expected, 2);
}

static int tensor_meta_matches(PyObject *ref, PyObject *expected);

static int
check_tensor(ValueGuard *guard)
{
    return tensor_meta_matches(guard->target, guard->expected);
}

static int
check_tensors(ValueGuard *guard)
{
    uint64_t version = nns_dict_version(guard->target);
    if (version == guard->version) {
        return 1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(guard->keys); i++) {
        int ok = tensor_meta_matches(PyTuple_GET_ITEM(guard->keys, i),
                                     PyTuple_GET_ITEM(guard->expected, i));
        if (ok != 1) {
            return ok;
        }
    }
    guard->version = version;
    return 1;
}

/* 1 when the tensor behind `ref` has the (dtype, device, shape) of `expected`, 0 when
 * not, -1 when it died. */
static int
tensor_meta_matches(PyObject *ref, PyObject *expected)
{
    static PyObject *fields[3];   /* interned once; immortal for the process */
    if (fields[0] == NULL) {
        fields[0] = PyUnicode_InternFromString("dtype");
        fields[1] = PyUnicode_InternFromString("device");
        fields[2] = PyUnicode_InternFromString("shape");
        if (fields[0] == NULL || fields[1] == NULL || fields[2] == NULL) {
            Py_CLEAR(fields[0]);
            PyErr_Clear();
            return 0;
        }
    }
    PyObject *tensor = nns_weakref_object(ref);
    if (tensor == Py_None) {
        return -1;
    }
    int ok = 1;
    Py_INCREF(tensor);   /* a getter may drop the last other reference */
    for (int i = 0; ok && i < 3; i++) {
        PyObject *value = PyObject_GetAttr(tensor, fields[i]);
        if (value == NULL) {
            PyErr_Clear();
            ok = 0;
            break;
        }
        PyObject *want = PyTuple_GET_ITEM(expected, i);
        if (i == 2) {   /* torch.Size against the recorded tuple */
            int eq = PyObject_RichCompareBool(value, want, Py_EQ);
            if (eq < 0) {
                PyErr_Clear();
            }
            ok = eq == 1;
        }
        else {
            ok = same_value(want, value);
        }
        Py_DECREF(value);
    }
    Py_DECREF(tensor);
    return ok;
}

static int
check_call(ValueGuard *guard)
{
    PyObject *result = PyObject_CallNoArgs(guard->target);
    if (result == NULL) {
        PyErr_Clear();
        return 0;
    }
    int ok = result == Py_True;
    Py_DECREF(result);
    return ok;
}

/* 1 when an expected value held weakly has died: nothing alive can be it, so a guard
 * comparing by identity that fails now can never hold again.  Runs no Python. */
static int
expected_died(ValueGuard *guard)
{
    if (guard->weak == NULL || guard->expected == NULL) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(guard->expected); i++) {
        if (guard->weak[i] && expected_item(guard, i) == NULL) {
            return 1;
        }
    }
    return 0;
}

/* A failed check of a guard whose expected values include a dead one is -1 (stale
 * for good: the lookup drops its entry) rather than 0 (a hook removed with its
 * function freed: the entry that guarded it would otherwise stay in the bucket,
 * failing on every miss and counting towards cache_size_limit). */
static int
unless_stale(ValueGuard *guard, int ok)
{
    return ok == 0 && expected_died(guard) ? -1 : ok;
}

int
value_guard_check(ValueGuard *guard)
{
    switch (guard->kind) {
    case VG_DICT:
        return unless_stale(guard, check_dict(guard));
    case VG_LIST:
        return unless_stale(guard, check_list(guard));
    case VG_CELL: {
        PyObject *content = PyCell_GET(guard->target);
        PyObject *want = expected_item(guard, 0);
        return unless_stale(guard, content != NULL && want != NULL && same_value(want, content));
    }
    case VG_FUNCTION:
        return check_function(guard);
    case VG_TENSOR:
        return check_tensor(guard);
    case VG_CALL:
        return check_call(guard);
    case VG_TENSORS:
        return check_tensors(guard);
    case VG_BYTES:
        return check_bytes(guard);
    case VG_SLOTS:
        return unless_stale(guard, check_slots(guard));
    }
    return 0;
}
