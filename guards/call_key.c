/* call_key.c - encoding the per-call key and hashing it with XXH3. */
#include "call_key.h"
#include "nns_globals.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

enum {
    TAG_NONE = 1, TAG_FALSE, TAG_TRUE, TAG_INT, TAG_BIGINT, TAG_FLOAT, TAG_STR,
    TAG_TUPLE, TAG_LIST, TAG_DICT, TAG_TENSOR, TAG_OBJECT, TAG_GRAD,
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
    Py_CLEAR(key->pins);
}

static int
put(CallKey *key, const void *bytes, size_t n)
{
    if (key->len + n > key->cap) {
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

/* Identity keys are only sound while the object cannot be freed and its address
 * reused: a stored key keeps such objects alive (pins). */
static int
pin(CallKey *key, PyObject *obj)
{
    if (!key->collect_pins) {
        return 0;
    }
    if (key->pins == NULL && (key->pins = PyList_New(0)) == NULL) {
        return -1;
    }
    return PyList_Append(key->pins, obj);
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

static int
put_tensor(CallKey *key, PyObject *t)
{
    int ret = -1;
    PyObject *dtype = NULL, *device = NULL, *shape = NULL, *stride = NULL, *grad = NULL;

    if (put_tag(key, TAG_TENSOR) < 0 || put_ptr(key, Py_TYPE(t)) < 0 || pin(key, (PyObject *)Py_TYPE(t)) < 0) {
        goto done;
    }
    /* torch.dtype objects are process-wide singletons: identity is the value. */
    if ((dtype = PyObject_GetAttr(t, nns_globals.str_dtype)) == NULL || put_ptr(key, dtype) < 0) {
        goto done;
    }
    /* torch.device hashes its (type, index) pair injectively. */
    if ((device = PyObject_GetAttr(t, nns_globals.str_device)) == NULL) {
        goto done;
    }
    Py_hash_t dev_hash = PyObject_Hash(device);
    if (dev_hash == -1 || put_i64(key, (int64_t)dev_hash) < 0) {
        goto done;
    }
    if ((shape = PyObject_GetAttr(t, nns_globals.str_shape)) == NULL || put_int_sequence(key, shape) < 0) {
        goto done;
    }
    if ((stride = PyObject_CallMethodNoArgs(t, nns_globals.str_stride)) == NULL ||
        put_int_sequence(key, stride) < 0) {
        goto done;
    }
    if ((grad = PyObject_GetAttr(t, nns_globals.str_requires_grad)) == NULL ||
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

static int
put_items(CallKey *key, unsigned char tag, PyObject *const *items, Py_ssize_t n, int depth)
{
    if (put_tag(key, tag) < 0 || put_i64(key, n) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (put_value(key, items[i], depth + 1) < 0) {
            return -1;
        }
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
    if (PyObject_TypeCheck(v, nns_globals.tensor_type)) {
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
            return put_items(key, TAG_TUPLE, &PyTuple_GET_ITEM(v, 0), PyTuple_GET_SIZE(v), depth);
        }
        else if (type == &PyList_Type) {
            return put_items(key, TAG_LIST, &PyList_GET_ITEM(v, 0), PyList_GET_SIZE(v), depth);
        }
        else if (type == &PyDict_Type) {
            if (put_tag(key, TAG_DICT) < 0 || put_i64(key, PyDict_GET_SIZE(v)) < 0) {
                return -1;
            }
            Py_ssize_t pos = 0;
            PyObject *k, *item;
            while (PyDict_Next(v, &pos, &k, &item)) {
                if (put_value(key, k, depth + 1) < 0 || put_value(key, item, depth + 1) < 0) {
                    return -1;
                }
            }
            return 0;
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
    PyObject *grad = PyObject_CallNoArgs(nns_globals.is_grad_enabled);
    if (grad == NULL) {
        return -1;
    }
    int grad_on = (grad == Py_True);
    Py_DECREF(grad);
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
