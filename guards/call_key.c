/* call_key.c - encoding the per-call key and hashing it with XXH3. */
#include "call_key.h"
#include "guard_env.h"
#include "tensor_meta.h"

#include <stddef.h>

/* The key copies NnsTensorMeta's fixed fields as bytes: no padding allowed. */
_Static_assert(offsetof(NnsTensorMeta, sizes) == 16, "NnsTensorMeta has padding");

#define XXH_INLINE_ALL
#include <xxhash.h>

enum {
    TAG_NONE = 1, TAG_FALSE, TAG_TRUE, TAG_INT, TAG_BIGINT, TAG_FLOAT, TAG_STR,
    TAG_TUPLE, TAG_LIST, TAG_DICT, TAG_TENSOR, TAG_OBJECT, TAG_GRAD,
    TAG_ALIAS,        /* a tensor seen earlier in this key: its index follows */
    TAG_SUBTYPE,      /* a subclass of tuple/int/float/str: its type, then the value */
    TAG_BUFFER,       /* a NumPy scalar: its type, then its bytes */
    TAG_DEVICE,       /* a torch.device: its hash (type and index) */
    TAG_TENSOR_META,  /* a plain tensor read in C++ (tensor_meta.h): type, fixed
                         fields, sizes, strides */
};

#define MAX_DEPTH 8
#define MAX_INLINE_STR 256

void
call_key_init(CallKey *key, int collect_pins)
{
    key->data = key->inline_buf;
    key->len = 0;
    key->cap = CALL_KEY_INLINE;
    key->hash = 0;
    key->pins = NULL;
    key->collect_pins = collect_pins;
    key->n_tensors = 0;
}

void
call_key_release(CallKey *key)
{
    if (key->data != key->inline_buf) {
        PyMem_Free(key->data);
    }
    key->data = key->inline_buf;
    key->len = 0;
    key->cap = CALL_KEY_INLINE;
    key->n_tensors = 0;
    Py_CLEAR(key->pins);
}

/* Room for `n` more bytes.  0, or -1 with MemoryError. */
static int
reserve(CallKey *key, size_t n)
{
    if (key->len + n <= key->cap) {
        return 0;
    }
    size_t cap = key->cap * 2;
    while (cap < key->len + n) {
        cap *= 2;
    }
    unsigned char *data = PyMem_Malloc(cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(data, key->data, key->len);
    if (key->data != key->inline_buf) {
        PyMem_Free(key->data);
    }
    key->data = data;
    key->cap = cap;
    return 0;
}

static int
put(CallKey *key, const void *bytes, size_t n)
{
    if (reserve(key, n) < 0) {
        return -1;
    }
    memcpy(key->data + key->len, bytes, n);
    key->len += n;
    return 0;
}

static inline int
put_tag(CallKey *key, unsigned char tag)
{
    return put(key, &tag, 1);
}

static inline int
put_i64(CallKey *key, int64_t v)
{
    return put(key, &v, sizeof(v));
}

static inline int
put_ptr(CallKey *key, const void *p)
{
    return put(key, &p, sizeof(p));
}

/* Identity keys are only sound while the object's address cannot be reused by
 * another object: a stored key holds a weak reference to it (the entry goes stale
 * when it dies, see cache_entry_check), or a strong one when it cannot be weakly
 * referenced. */
static int
pin(CallKey *key, PyObject *obj)
{
    if (!key->collect_pins) {
        return 0;
    }
    if (key->pins == NULL && (key->pins = PyList_New(0)) == NULL) {
        return -1;
    }
    PyObject *ref = NULL;   /* owned */
    if (PyType_SUPPORTS_WEAKREFS(Py_TYPE(obj))) {
        ref = PyWeakref_NewRef(obj, NULL);
        if (ref == NULL) {
            return -1;
        }
    }
    int err = PyList_Append(key->pins, ref != NULL ? ref : obj);
    Py_XDECREF(ref);
    return err;
}

static int
put_int_sequence(CallKey *key, PyObject *seq)
{
    /* torch.Size / tuple of ints */
    if (!PyTuple_Check(seq)) {
        PyErr_SetString(PyExc_TypeError, "nnscaler: tensor size/stride is not a tuple");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    if (put_i64(key, n) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (put_i64(key, v) < 0) {
            return -1;
        }
    }
    return 0;
}

/* The index of `t` among the tensors already put in this key, or -1.  Inputs that
 * are one tensor object share one placeholder in the graph (the tracer maps tensors
 * by identity), so which slots alias is part of what the graph was specialised on. */
static Py_ssize_t
seen_tensor(CallKey *key, PyObject *t)
{
    Py_ssize_t n = key->n_tensors < CALL_KEY_MAX_ALIAS ? key->n_tensors : CALL_KEY_MAX_ALIAS;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (key->tensors[i] == (void *)t) {
            return i;
        }
    }
    return -1;
}

static int
put_tensor(CallKey *key, PyObject *t)
{
    int ret = -1;
    PyObject *dtype = NULL, *device = NULL, *shape = NULL, *stride = NULL, *grad = NULL;

    Py_ssize_t earlier = seen_tensor(key, t);
    if (earlier >= 0) {
        return (put_tag(key, TAG_ALIAS) < 0 || put_i64(key, earlier) < 0) ? -1 : 0;
    }
    if (key->n_tensors < CALL_KEY_MAX_ALIAS) {
        /* an address only: the caller's slots keep these tensors alive meanwhile */
        key->tensors[key->n_tensors] = (void *)t;
    }
    else {
        /* more tensor inputs than we track: alias detection past here is off, so
         * say so in the key (such calls never share an entry with tracked ones) */
        if (put_tag(key, TAG_OBJECT) < 0) {
            goto done;
        }
    }
    key->n_tensors++;
    NnsTensorMeta meta;
    if (nns_tensor_meta(t, &meta)) {
        /* One record, written in place: tag, type, the fixed fields (scalar type ..
         * ndim, laid out without padding), sizes, strides. */
        const size_t head = offsetof(NnsTensorMeta, sizes);
        const size_t n = (size_t)meta.ndim * sizeof(int64_t);
        const void *type = Py_TYPE(t);
        if (reserve(key, 1 + sizeof(type) + head + 2 * n) < 0 ||
            pin(key, (PyObject *)Py_TYPE(t)) < 0) {
            goto done;
        }
        unsigned char *p = key->data + key->len;
        *p++ = TAG_TENSOR_META;
        memcpy(p, &type, sizeof(type));
        p += sizeof(type);
        memcpy(p, &meta, head);
        p += head;
        memcpy(p, meta.sizes, n);
        memcpy(p + n, meta.strides, n);
        key->len += 1 + sizeof(type) + head + 2 * n;
        ret = 0;
        goto done;
    }
    if (put_tag(key, TAG_TENSOR) < 0 || put_ptr(key, Py_TYPE(t)) < 0 || pin(key, (PyObject *)Py_TYPE(t)) < 0) {
        goto done;
    }
    /* torch.dtype objects are process-wide singletons: identity is the value. */
    if ((dtype = PyObject_GetAttr(t, guard_env.str_dtype)) == NULL || put_ptr(key, dtype) < 0) {
        goto done;
    }
    /* torch.device hashes its (type, index) pair injectively. */
    if ((device = PyObject_GetAttr(t, guard_env.str_device)) == NULL) {
        goto done;
    }
    Py_hash_t dev_hash = PyObject_Hash(device);
    if (dev_hash == -1 || put_i64(key, (int64_t)dev_hash) < 0) {
        goto done;
    }
    if ((shape = PyObject_GetAttr(t, guard_env.str_shape)) == NULL || put_int_sequence(key, shape) < 0) {
        goto done;
    }
    if ((stride = PyObject_CallMethodNoArgs(t, guard_env.str_stride)) == NULL ||
        put_int_sequence(key, stride) < 0) {
        goto done;
    }
    if ((grad = PyObject_GetAttr(t, guard_env.str_requires_grad)) == NULL ||
        put_tag(key, grad == Py_True ? TAG_TRUE : TAG_FALSE) < 0) {
        goto done;
    }
    ret = 0;
done:
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(grad);
    return ret;
}

static int put_value(CallKey *key, PyObject *v, int depth);

/* Items of a tuple (borrowed from `owner`, which the caller keeps alive and which
 * cannot change: tuples are immutable). */
static int
put_items(CallKey *key, unsigned char tag, PyObject *tuple, int depth)
{
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    if (put_tag(key, tag) < 0 || put_i64(key, n) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (put_value(key, PyTuple_GET_ITEM(tuple, i), depth + 1) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Lists and dicts are walked through an owned snapshot: a tensor getter (a tensor
 * subclass) can run Python that shrinks the container and frees its items. */
static int
put_list(CallKey *key, PyObject *list, int depth)
{
    PyObject *snapshot = PyList_AsTuple(list);   /* owned */
    if (snapshot == NULL) {
        return -1;
    }
    int err = put_items(key, TAG_LIST, snapshot, depth);
    Py_DECREF(snapshot);
    return err;
}

static int
put_dict(CallKey *key, PyObject *dict, int depth)
{
    PyObject *items = PyDict_Items(dict);   /* owned list of owned (key, value) pairs */
    if (items == NULL) {
        return -1;
    }
    int err = -1;
    Py_ssize_t n = PyList_GET_SIZE(items);
    if (put_tag(key, TAG_DICT) < 0 || put_i64(key, n) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        if (put_value(key, PyTuple_GET_ITEM(pair, 0), depth + 1) < 0 ||
            put_value(key, PyTuple_GET_ITEM(pair, 1), depth + 1) < 0) {
            goto done;
        }
    }
    err = 0;
done:
    Py_DECREF(items);
    return err;
}

/* Immutable values that are not of an exact builtin type but are keyed by value
 * rather than identity (a new object per call would otherwise recapture per call):
 * torch.Size and named tuples, NumPy scalars, torch.device.  1 when handled. */
static int
put_value_type(CallKey *key, PyObject *v, int depth)
{
    PyTypeObject *type = Py_TYPE(v);
    if (PyTuple_Check(v) || PyLong_Check(v) || PyFloat_Check(v) || PyUnicode_Check(v)) {
        if (type->tp_dictoffset != 0) {
            return 0;   /* instances may carry attributes beyond the value */
        }
        if (put_tag(key, TAG_SUBTYPE) < 0 || put_ptr(key, type) < 0 || pin(key, (PyObject *)type) < 0) {
            return -1;
        }
        if (PyTuple_Check(v)) {
            return put_items(key, TAG_TUPLE, v, depth) < 0 ? -1 : 1;
        }
        PyObject *base = PyLong_Check(v) ? PyNumber_Long(v)
                       : PyFloat_Check(v) ? PyFloat_FromDouble(PyFloat_AS_DOUBLE(v))
                       : PyUnicode_FromObject(v);
        if (base == NULL) {
            return -1;
        }
        int err = put_value(key, base, depth + 1);
        Py_DECREF(base);
        return err < 0 ? -1 : 1;
    }
    if (strncmp(type->tp_name, "numpy.", 6) == 0 && PyObject_CheckBuffer(v)) {
        Py_buffer view;
        if (PyObject_GetBuffer(v, &view, PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            return 0;
        }
        int err = put_tag(key, TAG_BUFFER) < 0 || put_ptr(key, type) < 0 ||
                  pin(key, (PyObject *)type) < 0 || put_i64(key, view.len) < 0 ||
                  put(key, view.buf, (size_t)view.len) < 0;
        PyBuffer_Release(&view);
        return err ? -1 : 1;
    }
    if (strcmp(type->tp_name, "torch.device") == 0) {
        /* torch.device hashes its (type, index) pair injectively */
        Py_hash_t hash = PyObject_Hash(v);
        if (hash == -1) {
            return -1;
        }
        return (put_tag(key, TAG_DEVICE) < 0 || put_i64(key, (int64_t)hash) < 0) ? -1 : 1;
    }
    return 0;
}

static int
put_value(CallKey *key, PyObject *v, int depth)
{
    if (v == Py_None) {
        return put_tag(key, TAG_NONE);
    }
    if (v == Py_True || v == Py_False) {
        return put_tag(key, v == Py_True ? TAG_TRUE : TAG_FALSE);
    }
    PyTypeObject *type = Py_TYPE(v);
    if (PyObject_TypeCheck(v, guard_env.tensor_type)) {
        return put_tensor(key, v);
    }
    if (depth < MAX_DEPTH) {
        if (type == &PyLong_Type) {
            int overflow = 0;
            long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (!overflow) {
                return (put_tag(key, TAG_INT) < 0 || put_i64(key, x) < 0) ? -1 : 0;
            }
            /* Large ints: fall through to identity (pinned). */
        }
        else if (type == &PyFloat_Type) {
            double d = PyFloat_AS_DOUBLE(v);
            return (put_tag(key, TAG_FLOAT) < 0 || put(key, &d, sizeof(d)) < 0) ? -1 : 0;
        }
        else if (type == &PyUnicode_Type) {
            Py_ssize_t size = 0;
            const char *utf8 = PyUnicode_AsUTF8AndSize(v, &size);
            if (utf8 == NULL) {
                return -1;
            }
            if (size <= MAX_INLINE_STR) {
                return (put_tag(key, TAG_STR) < 0 || put_i64(key, size) < 0 ||
                        put(key, utf8, (size_t)size) < 0) ? -1 : 0;
            }
        }
        else if (type == &PyTuple_Type) {
            return put_items(key, TAG_TUPLE, v, depth);
        }
        else if (type == &PyList_Type) {
            return put_list(key, v, depth);
        }
        else if (type == &PyDict_Type) {
            return put_dict(key, v, depth);
        }
        else {
            int handled = put_value_type(key, v, depth);
            if (handled != 0) {
                return handled < 0 ? -1 : 0;
            }
        }
    }
    /* Anything else: by type and identity; the stored key pins the object. */
    if (put_tag(key, TAG_OBJECT) < 0 || put_ptr(key, type) < 0 || put_ptr(key, v) < 0) {
        return -1;
    }
    return pin(key, v);
}

int
call_key_build(CallKey *key, PyObject *const *values, Py_ssize_t n)
{
    int grad_on = nns_grad_mode();
    if (grad_on < 0) {   /* built without torch's headers */
        PyObject *grad = PyObject_CallNoArgs(guard_env.is_grad_enabled);
        if (grad == NULL) {
            return -1;
        }
        grad_on = (grad == Py_True);
        Py_DECREF(grad);
    }
    /* Most keys are a few tensors; many inputs would otherwise grow the buffer
     * (and copy it) several times. */
    if (n > 6 && reserve(key, 2 + (size_t)n * 80) < 0) {
        return -1;
    }
    if (put_tag(key, TAG_GRAD) < 0 || put_tag(key, grad_on ? TAG_TRUE : TAG_FALSE) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (put_value(key, values[i], 0) < 0) {
            return -1;
        }
    }
    key->hash = XXH3_64bits(key->data, key->len);
    return 0;
}
