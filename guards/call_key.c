/* call_key.c - encoding the per-call key and hashing it with XXH3; decoding it
 * (call_key_describe, call_key_pin_from_bytes): the one reader of these bytes. */
#include "call_key.h"
#include "guard_env.h"
#include "tensor_meta.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

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
    TAG_DEVICE,       /* a torch.device (put_device) */
    TAG_TENSOR_META,  /* a plain tensor read in C++ (tensor_meta.h): type, fixed
                         fields, sizes, strides */
    TAG_UNTRACKED,    /* the tensor that follows is past CALL_KEY_MAX_ALIAS: alias
                         detection is off from there */
    TAG_STRUCT,       /* an object of a structured type (call_key_set_struct_types):
                         its type, then its instance __dict__ as a TAG_DICT */
    TAG_SHARED,       /* a structured object, or a list or dict inside one, met
                         earlier in this key: its index among them follows */
};

/* How the Python path (TAG_TENSOR) records a tensor's dtype, and how it and TAG_DEVICE
 * record a device: the first byte says which form follows. */
enum {
    DTYPE_SCALAR_TYPE = 0,   /* int32 c10::ScalarType of a torch.dtype */
    DTYPE_OBJECT,            /* something else (or no torch headers): its address, pinned */
};
enum {
    DEVICE_PARTS = 0,        /* int16 c10::DeviceType, int16 c10::DeviceIndex */
    DEVICE_HASH,             /* no torch headers: the torch.device's hash, which is
                                injective on (type, index) */
};

#define MAX_DEPTH 8
#define MAX_INLINE_STR 256

void
call_key_init(CallKey *key, int flags)
{
    key->data = key->inline_buf;
    key->len = 0;
    key->cap = CALL_KEY_INLINE;
    key->pins = NULL;
    key->flags = flags;
    key->n_tensors = 0;
    key->in_struct = 0;
    key->n_shared = 0;
    key->cap_shared = CALL_KEY_SHARED_INLINE;
    key->shared = key->shared_inline;
}

/* Keys of the hit path that outgrow their inline buffer (many inputs) borrow one
 * block kept for them, instead of a malloc and a free per call (about 250
 * instructions per tensor input at 32 inputs).  The block is lent to one key at a
 * time: a key built while it is out (by a call nested in a tensor subclass's getter,
 * or by another thread while this one runs Python) gets a block of its own, and a
 * stored key (CALL_KEY_PINS) never borrows.  A key moved elsewhere takes the block
 * with it.  Protected by the GIL. */
static unsigned char *spare;    /* owned, or NULL */
static size_t spare_cap;
static int spare_lent;

void
call_key_release(CallKey *key)
{
    if (key->data == spare) {
        spare_lent = 0;
    }
    else if (key->data != key->inline_buf) {
        PyMem_Free(key->data);
    }
    key->data = key->inline_buf;
    key->len = 0;
    key->cap = CALL_KEY_INLINE;
    key->n_tensors = 0;
    key->in_struct = 0;
    key->n_shared = 0;
    if (key->shared != key->shared_inline) {
        PyMem_Free(key->shared);
        key->shared = key->shared_inline;
        key->cap_shared = CALL_KEY_SHARED_INLINE;
    }
    Py_CLEAR(key->pins);
}

/* Room for `n` more bytes, growing the buffer.  0, or -1 with MemoryError. */
static int __attribute__((noinline))
grow(CallKey *key, size_t n)
{
    size_t cap = key->cap * 2;
    while (cap < key->len + n) {
        cap *= 2;
    }
    if (key->data == spare ||
        (key->data == key->inline_buf && !(key->flags & CALL_KEY_PINS) && !spare_lent)) {
        if (spare_cap < cap) {
            unsigned char *grown = PyMem_Realloc(spare, cap);   /* keeps what it held */
            if (grown == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            if (key->data == spare) {
                key->data = grown;
            }
            spare = grown;
            spare_cap = cap;
        }
        if (key->data != spare) {
            memcpy(spare, key->data, key->len);
            key->data = spare;
            spare_lent = 1;
        }
        key->cap = spare_cap;
        return 0;
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

/* Room for `n` more bytes.  0, or -1 with MemoryError. */
static inline int
reserve(CallKey *key, size_t n)
{
    return key->len + n <= key->cap ? 0 : grow(key, n);
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
static int __attribute__((noinline))
pin_stored(CallKey *key, PyObject *obj)
{
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

static inline int
pin(CallKey *key, PyObject *obj)
{
    return (key->flags & CALL_KEY_PINS) ? pin_stored(key, obj) : 0;
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

/* The alias set's first slot for address `t`: Fibonacci hashing (objects are
 * 16-byte aligned) to 7 bits. */
static inline size_t
alias_slot(const void *t)
{
    return (size_t)((((uintptr_t)t >> 4) * UINT64_C(0x9E3779B97F4A7C15)) >> 57);
}

/* The set's slot holding tensor `t`, or the empty slot where it would go (linear
 * probing; the set is at most half full). */
static inline size_t
alias_probe(const CallKey *key, const void *t)
{
    size_t i = alias_slot(t);
    for (unsigned at; (at = key->alias_set[i]) != 0; i = (i + 1) & (CALL_KEY_ALIAS_SLOTS - 1)) {
        if (key->tensors[at - 1] == t) {
            break;
        }
    }
    return i;
}

/* The index of `t` among the tensors already put in this key, or -1 after making
 * it the next tracked one (while fewer than CALL_KEY_MAX_ALIAS are).  Inputs that
 * are one tensor object share one placeholder in the graph (the tracer maps tensors
 * by identity), so which slots alias is part of what the graph was specialised on.
 * The first CALL_KEY_ALIAS_LINEAR tensors are compared one by one; from the next
 * one on, each takes one probe sequence of the alias set. */
static inline Py_ssize_t
seen_or_remember(CallKey *key, PyObject *t)
{
    const Py_ssize_t index = key->n_tensors;
    if (index <= CALL_KEY_ALIAS_LINEAR) {
        for (Py_ssize_t i = 0; i < index; i++) {
            if (key->tensors[i] == (void *)t) {
                return i;
            }
        }
        key->tensors[index] = (void *)t;
        if (index == CALL_KEY_ALIAS_LINEAR) {   /* the set starts here, with all so far */
            memset(key->alias_set, 0, sizeof(key->alias_set));
            for (Py_ssize_t i = 0; i <= index; i++) {
                key->alias_set[alias_probe(key, key->tensors[i])] = (unsigned char)(i + 1);
            }
        }
        return -1;
    }
    const size_t slot = alias_probe(key, t);
    const unsigned at = key->alias_set[slot];
    if (at != 0) {
        return (Py_ssize_t)at - 1;
    }
    if (index < CALL_KEY_MAX_ALIAS) {
        /* an address only: the caller's slots keep these tensors alive meanwhile */
        key->tensors[index] = (void *)t;
        key->alias_set[slot] = (unsigned char)(index + 1);
    }
    return -1;
}

/* A torch.device (DEVICE_* above).  Runs no Python. */
static int
put_device(CallKey *key, PyObject *device)
{
    int16_t parts[2];
    if (nns_device_parts(device, &parts[0], &parts[1])) {
        return (put_tag(key, DEVICE_PARTS) < 0 || put(key, parts, sizeof(parts)) < 0) ? -1 : 0;
    }
    if (strcmp(Py_TYPE(device)->tp_name, "torch.device") != 0) {
        PyErr_Format(PyExc_TypeError, "nnscaler: a tensor's device is a %.100s, not a torch.device",
                     Py_TYPE(device)->tp_name);
        return -1;
    }
    /* torch.device hashes its (type, index) pair injectively (C++, no Python). */
    Py_hash_t hash = PyObject_Hash(device);
    if (hash == -1) {
        return -1;
    }
    return (put_tag(key, DEVICE_HASH) < 0 || put_i64(key, (int64_t)hash) < 0) ? -1 : 0;
}

/* A tensor whose C++ record could not be read (a subclass, a nested or sparse
 * tensor): its attributes through Python, which a subclass's getters may run. */
static int __attribute__((noinline))
put_tensor_through_python(CallKey *key, PyObject *t)
{
    int ret = -1;
    PyObject *dtype = NULL, *device = NULL, *shape = NULL, *stride = NULL, *grad = NULL;

    key->flags |= CALL_KEY_RAN_PYTHON;
    if (put_tag(key, TAG_TENSOR) < 0 || put_ptr(key, Py_TYPE(t)) < 0 || pin(key, (PyObject *)Py_TYPE(t)) < 0) {
        goto done;
    }
    if ((dtype = PyObject_GetAttr(t, guard_env.str_dtype)) == NULL) {
        goto done;
    }
    int32_t scalar_type = nns_dtype_scalar_type(dtype);
    if (scalar_type >= 0) {
        if (put_tag(key, DTYPE_SCALAR_TYPE) < 0 || put(key, &scalar_type, sizeof(scalar_type)) < 0) {
            goto done;
        }
    }
    /* torch.dtype objects are process-wide singletons: identity is the value; anything
     * else a subclass returns is pinned like any object keyed by identity. */
    else if (put_tag(key, DTYPE_OBJECT) < 0 || put_ptr(key, dtype) < 0 || pin(key, dtype) < 0) {
        goto done;
    }
    if ((device = PyObject_GetAttr(t, guard_env.str_device)) == NULL || put_device(key, device) < 0) {
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

/* Inlined into call_key_build's loop (most arguments are plain tensors): a call per
 * tensor cost a dozen instructions of register saves. */
static inline __attribute__((always_inline)) int
put_tensor(CallKey *key, PyObject *t, int exact)
{
    Py_ssize_t earlier = seen_or_remember(key, t);
    if (earlier >= 0) {
        return (put_tag(key, TAG_ALIAS) < 0 || put_i64(key, earlier) < 0) ? -1 : 0;
    }
    /* more tensor inputs than we track: alias detection past here is off, so say so
     * in the key (such calls never share an entry with tracked ones) */
    if (key->n_tensors >= CALL_KEY_MAX_ALIAS && put_tag(key, TAG_UNTRACKED) < 0) {
        return -1;
    }
    key->n_tensors++;
    /* One record, written in place by C++: tag, type, the fixed fields (scalar type ..
     * ndim, laid out without padding), sizes, strides. */
    const void *type = Py_TYPE(t);
    if (reserve(key, 1 + sizeof(type) + NNS_TENSOR_RECORD_MAX) < 0) {
        return -1;
    }
    unsigned char *p = key->data + key->len;
    size_t written = exact ? nns_tensor_record_exact(t, p + 1 + sizeof(type))
                           : nns_tensor_record(t, p + 1 + sizeof(type));
    if (written == 0) {
        return put_tensor_through_python(key, t);
    }
    p[0] = TAG_TENSOR_META;
    memcpy(p + 1, &type, sizeof(type));
    key->len += 1 + sizeof(type) + written;
    /* After the record: pinning allocates, and so may run the GC (our buffer is not
     * reachable from Python; the record describes the tensor as it was). */
    return pin(key, (PyObject *)Py_TYPE(t));
}

static int put_value(CallKey *key, PyObject *v, int depth);

/* torch.Tensor, the type almost every tensor argument has exactly: compared first,
 * before the subtype check against guard_env.tensor_type walks its MRO. */
static PyTypeObject *tensor_class;

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
    key->flags |= CALL_KEY_RAN_PYTHON;   /* the snapshot's allocation may run the GC */
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
    key->flags |= CALL_KEY_RAN_PYTHON;   /* the snapshot's allocation may run the GC */
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

/* A structured object, or a list or dict inside one: 1 when it was met before in
 * this key (TAG_SHARED and its index written), 0 when it is new (recorded; the
 * caller writes it), -1 on error.  The runner writes into these objects, so one
 * object reached twice must not key like two equal ones. */
static int
put_shared(CallKey *key, PyObject *v)
{
    for (Py_ssize_t i = 0; i < key->n_shared; i++) {
        if (key->shared[i] == (void *)v) {
            return (put_tag(key, TAG_SHARED) < 0 || put_i64(key, i) < 0) ? -1 : 1;
        }
    }
    if (key->n_shared == key->cap_shared) {
        Py_ssize_t cap = key->cap_shared * 2;
        void **grown = key->shared == key->shared_inline
            ? PyMem_Malloc(sizeof(void *) * (size_t)cap)
            : PyMem_Realloc(key->shared, sizeof(void *) * (size_t)cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if (key->shared == key->shared_inline) {
            memcpy(grown, key->shared_inline, sizeof(key->shared_inline));
        }
        key->shared = grown;
        key->cap_shared = cap;
    }
    key->shared[key->n_shared++] = (void *)v;
    return 0;
}

/* Types whose instances are keyed by their contents (call_key_set_struct_types):
 * owned, compared by address, so checking a type runs no Python. */
static PyTypeObject *struct_types[CALL_KEY_MAX_STRUCT_TYPES];
static int n_struct_types;

int
call_key_set_struct_types(PyObject *types)
{
    if (!PyTuple_Check(types) || PyTuple_GET_SIZE(types) > CALL_KEY_MAX_STRUCT_TYPES) {
        PyErr_Format(PyExc_TypeError, "set_struct_types: expected a tuple of at most %d "
                     "classes, got %.100s", CALL_KEY_MAX_STRUCT_TYPES, Py_TYPE(types)->tp_name);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(types);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *type = PyTuple_GET_ITEM(types, i);
        if (!PyType_Check(type) || ((PyTypeObject *)type)->tp_dictoffset == 0) {
            PyErr_Format(PyExc_TypeError, "set_struct_types: item %zd is %.100R, not a "
                         "class whose instances have a __dict__", i, type);
            return -1;
        }
    }
    PyTypeObject *old[CALL_KEY_MAX_STRUCT_TYPES];
    int n_old = n_struct_types;
    memcpy(old, struct_types, sizeof(old));
    for (Py_ssize_t i = 0; i < n; i++) {
        struct_types[i] = (PyTypeObject *)Py_NewRef(PyTuple_GET_ITEM(types, i));
    }
    n_struct_types = (int)n;
    for (int i = 0; i < n_old; i++) {
        Py_DECREF(old[i]);   /* classes: no finaliser of an instance runs */
    }
    return 0;
}

static inline int
is_struct_type(PyTypeObject *type)
{
    for (int i = 0; i < n_struct_types; i++) {
        if (struct_types[i] == type) {
            return 1;
        }
    }
    return 0;
}

/* A structured object: its type (pinned), then its __dict__ by value.  1 when
 * handled, 0 when it has no plain dict (keyed by identity instead), -1 on error. */
static int
put_struct(CallKey *key, PyObject *v, int depth)
{
    PyObject *dict = nns_object_dict(v);
    if (dict == NULL || !PyDict_CheckExact(dict)) {
        return 0;
    }
    int seen = put_shared(key, v);
    if (seen != 0) {
        return seen;
    }
    PyTypeObject *type = Py_TYPE(v);
    if (put_tag(key, TAG_STRUCT) < 0 || put_ptr(key, type) < 0 || pin(key, (PyObject *)type) < 0) {
        return -1;
    }
    /* put_dict walks a snapshot of the items: `v` (kept alive by our caller) may lose
     * this dict meanwhile without freeing what the walk reads. */
    Py_INCREF(dict);
    key->in_struct++;
    int err = put_dict(key, dict, depth + 1);
    key->in_struct--;
    Py_DECREF(dict);
    return err < 0 ? -1 : 1;
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
        key->flags |= CALL_KEY_RAN_PYTHON;   /* __int__ of an int subclass, the GC */
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
        key->flags |= CALL_KEY_RAN_PYTHON;   /* NumPy's buffer export */
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
        return (put_tag(key, TAG_DEVICE) < 0 || put_device(key, v) < 0) ? -1 : 1;
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
    if (type == tensor_class || PyObject_TypeCheck(v, guard_env.tensor_type)) {
        return put_tensor(key, v, 0);
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
        else if (type == &PyList_Type || type == &PyDict_Type) {
            if (key->in_struct > 0) {
                int seen = put_shared(key, v);
                if (seen != 0) {
                    return seen < 0 ? -1 : 0;
                }
            }
            return type == &PyList_Type ? put_list(key, v, depth) : put_dict(key, v, depth);
        }
        else {
            int handled = n_struct_types > 0 && is_struct_type(type)
                          ? put_struct(key, v, depth) : 0;
            if (handled == 0) {
                handled = put_value_type(key, v, depth);
            }
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
    if (tensor_class == NULL) {
        PyTypeObject *parameter;
        if (!nns_tensor_classes(&tensor_class, &parameter)) {
            tensor_class = NULL;   /* torch._C not initialised yet: asked again next time */
        }
    }
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
        /* A plain torch.Tensor (most arguments) goes straight to its record. */
        if (Py_TYPE(values[i]) == tensor_class ? put_tensor(key, values[i], 1) < 0
                                               : put_value(key, values[i], 0) < 0) {
            return -1;
        }
    }
    return 0;
}

uint64_t
call_key_hash(const CallKey *key)
{
    return XXH3_64bits(key->data, key->len);
}

void
call_key_move(CallKey *dst, CallKey *src)
{
    call_key_release(dst);
    if (src->data == src->inline_buf) {
        memcpy(dst->inline_buf, src->inline_buf, src->len);
    }
    else {
        dst->data = src->data;   /* the block moves */
        dst->cap = src->cap;
        if (src->data == spare) {   /* and is the spare no more */
            spare = NULL;
            spare_cap = 0;
            spare_lent = 0;
        }
    }
    dst->len = src->len;
    dst->pins = src->pins;       /* moved */
    dst->flags = (dst->flags & CALL_KEY_PINS) | (src->flags & ~CALL_KEY_PINS);
    dst->n_tensors = src->n_tensors;
    src->data = src->inline_buf;
    src->cap = CALL_KEY_INLINE;
    src->pins = NULL;
    call_key_release(src);
}

/* ---------------------------------------------------------------- decoding
 *
 * One reader of the bytes put above, for two uses: describing a key in words, and
 * collecting the addresses a key pins (in the order pin() met them, which is the order
 * of their bytes).  It reads the bytes and, where the key pins an address, the pin;
 * it never dereferences any other address, reads no attribute and runs no Python.
 */

typedef struct {
    char *buf;      /* PyMem, NUL-terminated when not NULL */
    size_t len, cap;
} Text;

typedef struct {
    const unsigned char *p, *end;
    int malformed, no_memory;
    int describing;                 /* else collecting the pinned addresses */
    /* describing */
    Text out;                       /* the line being written */
    Text path;                      /* where the value being read is: "x[0]['k']" */
    PyObject *pins;                 /* borrowed list, or NULL */
    Py_ssize_t next_pin;
    Py_ssize_t n_tensors;
    char *tensor_paths[CALL_KEY_MAX_ALIAS];   /* PyMem copies of tracked tensors' paths */
    /* collecting */
    PyObject **held;                /* PyMem array of owned references */
    Py_ssize_t n_held, cap_held;
} Reader;

#define MAX_READ_DEPTH 64   /* deeper than any key put_value writes: malformed */
#define MAX_PATH 160

static void
text_put(Reader *r, Text *t, const char *s, size_t n)
{
    if (!r->describing || r->no_memory) {
        return;
    }
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 128;
        while (cap < t->len + n + 1) {
            cap *= 2;
        }
        char *buf = PyMem_Realloc(t->buf, cap);
        if (buf == NULL) {
            r->no_memory = 1;
            return;
        }
        t->buf = buf;
        t->cap = cap;
    }
    memcpy(t->buf + t->len, s, n);
    t->len += n;
    t->buf[t->len] = '\0';
}

static void
out_s(Reader *r, const char *s)
{
    text_put(r, &r->out, s, strlen(s));
}

static void
out_f(Reader *r, const char *fmt, ...)
{
    char small[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof(small), fmt, ap);
    va_end(ap);
    if (n > 0) {
        text_put(r, &r->out, small, (size_t)n < sizeof(small) ? (size_t)n : sizeof(small) - 1);
    }
}

static int
rd(Reader *r, void *dst, size_t n)
{
    if (r->malformed || (size_t)(r->end - r->p) < n) {
        r->malformed = 1;
        memset(dst, 0, n);
        return -1;
    }
    memcpy(dst, r->p, n);
    r->p += n;
    return 0;
}

static unsigned char
rd_tag(Reader *r)
{
    unsigned char tag = 0;
    rd(r, &tag, 1);
    return tag;
}

static int64_t
rd_i64(Reader *r)
{
    int64_t v = 0;
    rd(r, &v, sizeof(v));
    return v;
}

static const void *
rd_ptr(Reader *r)
{
    const void *p = NULL;
    rd(r, &p, sizeof(p));
    return p;
}

/* The object at an address the key pins.  Collecting: held (it is alive, see
 * call_key_pin_from_bytes) and returned.  Describing: the object its pin names when
 * that is still this address, else NULL (it died, or the key has no pins). */
static PyObject *
rd_pinned(Reader *r, const void *addr)
{
    if (r->malformed) {
        return NULL;
    }
    if (!r->describing) {
        if (r->n_held == r->cap_held) {
            Py_ssize_t cap = r->cap_held ? r->cap_held * 2 : 16;
            PyObject **held = PyMem_Realloc(r->held, sizeof(PyObject *) * (size_t)cap);
            if (held == NULL) {
                r->no_memory = 1;
                return NULL;
            }
            r->held = held;
            r->cap_held = cap;
        }
        r->held[r->n_held++] = Py_NewRef((PyObject *)addr);
        return (PyObject *)addr;
    }
    if (r->pins == NULL || r->next_pin >= PyList_GET_SIZE(r->pins)) {
        return NULL;
    }
    PyObject *pin = PyList_GET_ITEM(r->pins, r->next_pin++);
    if ((const void *)pin == addr) {
        return pin;   /* held strongly: not weakly referenceable */
    }
    if (PyWeakref_CheckRef(pin)) {
        PyObject *obj = nns_weakref_object(pin);
        if ((const void *)obj == addr) {
            return obj;
        }
    }
    return NULL;
}

/* type.__name__, read from the type object (no Python). */
static const char *
type_name(PyTypeObject *type)
{
    const char *name = type->tp_name;
    if (!(type->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
        const char *dot = strrchr(name, '.');
        if (dot != NULL) {
            name = dot + 1;
        }
    }
    return name;
}

static void
out_pinned_type(Reader *r, const void *addr)
{
    PyObject *type = rd_pinned(r, addr);
    if (type != NULL && PyType_Check(type)) {
        out_s(r, type_name((PyTypeObject *)type));
    }
    else {
        out_f(r, "<type at %p, collected>", addr);
    }
}

static void
out_ints(Reader *r, const int64_t *v, int64_t n)
{
    out_s(r, "(");
    for (int64_t i = 0; i < n; i++) {
        out_f(r, i ? ", %lld" : "%lld", (long long)v[i]);
    }
    out_s(r, n == 1 ? ",)" : ")");
}

/* A tuple of int64 as put_int_sequence writes it. */
static void
rd_int_sequence(Reader *r)
{
    int64_t n = rd_i64(r);
    if (n < 0 || n > (int64_t)((r->end - r->p) / (ptrdiff_t)sizeof(int64_t))) {
        r->malformed = 1;
        return;
    }
    out_s(r, "(");
    for (int64_t i = 0; i < n; i++) {
        out_f(r, i ? ", %lld" : "%lld", (long long)rd_i64(r));
    }
    out_s(r, n == 1 ? ",)" : ")");
}

static void
out_scalar_type(Reader *r, int32_t scalar_type)
{
    const char *name = nns_scalar_type_name(scalar_type);
    if (name != NULL) {
        out_s(r, name);
    }
    else {
        out_f(r, "scalar_type %d", (int)scalar_type);
    }
}

static void
out_device_parts(Reader *r, int16_t type, int16_t index)
{
    char name[64];
    if (r->describing && nns_device_name(type, index, name, sizeof(name))) {
        out_s(r, name);
    }
    else {
        out_f(r, "device_type %d index %d", (int)type, (int)index);
    }
}

/* A device as put_device writes it. */
static void
rd_device(Reader *r)
{
    unsigned char form = rd_tag(r);
    if (form == DEVICE_PARTS) {
        int16_t parts[2];
        rd(r, parts, sizeof(parts));
        out_device_parts(r, parts[0], parts[1]);
    }
    else if (form == DEVICE_HASH) {
        out_f(r, "device hash %lld", (long long)rd_i64(r));
    }
    else {
        r->malformed = 1;
    }
}

static void
note_tensor_path(Reader *r)
{
    Py_ssize_t index = r->n_tensors++;
    if (!r->describing || index >= CALL_KEY_MAX_ALIAS || r->path.buf == NULL) {
        return;
    }
    size_t n = r->path.len + 1;
    char *copy = PyMem_Malloc(n);
    if (copy == NULL) {
        r->no_memory = 1;
        return;
    }
    memcpy(copy, r->path.buf, n);
    r->tensor_paths[index] = copy;
}

/* TAG_TENSOR_META or TAG_TENSOR (the tag read), in the words of the old
 * Python description: Type(dtype, device, shape=..., stride=..., requires_grad=...). */
static void
rd_tensor(Reader *r, unsigned char tag)
{
    note_tensor_path(r);
    out_pinned_type(r, rd_ptr(r));
    out_s(r, "(");
    if (tag == TAG_TENSOR_META) {
        NnsTensorMeta meta;
        rd(r, &meta, offsetof(NnsTensorMeta, sizes));
        if (meta.ndim < 0 || meta.ndim > NNS_TENSOR_META_MAX_DIM) {
            r->malformed = 1;
            return;
        }
        rd(r, meta.sizes, (size_t)meta.ndim * sizeof(int64_t));
        rd(r, meta.strides, (size_t)meta.ndim * sizeof(int64_t));
        out_scalar_type(r, meta.scalar_type);
        out_s(r, ", ");
        out_device_parts(r, meta.device_type, meta.device_index);
        out_s(r, ", shape=");
        out_ints(r, meta.sizes, meta.ndim);
        out_s(r, ", stride=");
        out_ints(r, meta.strides, meta.ndim);
        out_s(r, meta.requires_grad ? ", requires_grad=True)" : ", requires_grad=False)");
        return;
    }
    unsigned char form = rd_tag(r);
    if (form == DTYPE_SCALAR_TYPE) {
        int32_t scalar_type = 0;
        rd(r, &scalar_type, sizeof(scalar_type));
        out_scalar_type(r, scalar_type);
    }
    else if (form == DTYPE_OBJECT) {
        const void *addr = rd_ptr(r);
        PyObject *dtype = rd_pinned(r, addr);
        out_f(r, "<%s object at %p>", dtype ? type_name(Py_TYPE(dtype)) : "collected", addr);
    }
    else {
        r->malformed = 1;
    }
    out_s(r, ", ");
    rd_device(r);
    out_s(r, ", shape=");
    rd_int_sequence(r);
    out_s(r, ", stride=");
    rd_int_sequence(r);
    unsigned char grad = rd_tag(r);
    if (grad != TAG_TRUE && grad != TAG_FALSE) {
        r->malformed = 1;
    }
    out_s(r, grad == TAG_TRUE ? ", requires_grad=True)" : ", requires_grad=False)");
}

/* The value of a NumPy scalar from its bytes, by its type's name and size. */
static void
out_numpy_value(Reader *r, const char *name, const unsigned char *bytes, int64_t n)
{
    if (strncmp(name, "float", 5) == 0 && (n == 8 || n == 4)) {
        double d;
        if (n == 8) {
            memcpy(&d, bytes, 8);
        }
        else {
            float f;
            memcpy(&f, bytes, 4);
            d = f;
        }
        char *text = PyOS_double_to_string(d, n == 8 ? 'r' : 'g', n == 8 ? 0 : 9,
                                           Py_DTSF_ADD_DOT_0, NULL);
        if (text == NULL) {
            r->no_memory = 1;
            return;
        }
        out_s(r, text);
        PyMem_Free(text);
        return;
    }
    int is_unsigned = strncmp(name, "uint", 4) == 0;
    if ((is_unsigned || strncmp(name, "int", 3) == 0) && (n == 1 || n == 2 || n == 4 || n == 8)) {
        if (is_unsigned) {
            uint64_t u = 0;
            if (n == 1) { uint8_t x; memcpy(&x, bytes, 1); u = x; }
            else if (n == 2) { uint16_t x; memcpy(&x, bytes, 2); u = x; }
            else if (n == 4) { uint32_t x; memcpy(&x, bytes, 4); u = x; }
            else { memcpy(&u, bytes, 8); }
            out_f(r, "%llu", (unsigned long long)u);
        }
        else {
            int64_t v = 0;
            if (n == 1) { int8_t x; memcpy(&x, bytes, 1); v = x; }
            else if (n == 2) { int16_t x; memcpy(&x, bytes, 2); v = x; }
            else if (n == 4) { int32_t x; memcpy(&x, bytes, 4); v = x; }
            else { memcpy(&v, bytes, 8); }
            out_f(r, "%lld", (long long)v);
        }
        return;
    }
    if (strncmp(name, "bool", 4) == 0 && n == 1 && bytes[0] <= 1) {
        out_s(r, bytes[0] ? "True" : "False");
        return;
    }
    out_s(r, "bytes 0x");
    for (int64_t i = 0; i < n; i++) {
        out_f(r, "%02x", bytes[i]);
    }
}

static void rd_value(Reader *r, int depth);

/* Items of a tuple/list, each read with its index appended to the path. */
static void
rd_items(Reader *r, int depth, const char *open, const char *close, int one_comma)
{
    int64_t n = rd_i64(r);
    if (n < 0 || n > r->end - r->p) {
        r->malformed = 1;
        return;
    }
    size_t path_len = r->path.len;
    out_s(r, open);
    for (int64_t i = 0; i < n && !r->malformed; i++) {
        if (i) {
            out_s(r, ", ");
        }
        if (path_len < MAX_PATH) {
            char index[32];
            int len = snprintf(index, sizeof(index), "[%lld]", (long long)i);
            text_put(r, &r->path, index, (size_t)len);
        }
        rd_value(r, depth + 1);
        if (r->path.buf != NULL) {
            r->path.len = path_len;
            r->path.buf[path_len] = '\0';
        }
    }
    out_s(r, n == 1 && one_comma ? ",)" : close);
}

/* A dict's items; `attrs`: an object's __dict__ (TAG_STRUCT), whose keys read as
 * attribute names in paths (`.keys`, not `['keys']`). */
static void
rd_dict(Reader *r, int depth, int attrs)
{
    int64_t n = rd_i64(r);
    if (n < 0 || n > r->end - r->p) {
        r->malformed = 1;
        return;
    }
    size_t path_len = r->path.len;
    out_s(r, "{");
    for (int64_t i = 0; i < n && !r->malformed; i++) {
        if (i) {
            out_s(r, ", ");
        }
        size_t key_at = r->out.len;
        rd_value(r, depth + 1);   /* the dict key (a tensor key's path: the dict's) */
        size_t key_len = r->out.buf != NULL ? r->out.len - key_at : 0;
        if (path_len < MAX_PATH && attrs && key_len >= 2 && r->out.buf[key_at] == '\'') {
            text_put(r, &r->path, ".", 1);
            text_put(r, &r->path, r->out.buf + key_at + 1, key_len - 2);
        }
        else if (path_len < MAX_PATH && r->out.buf != NULL) {
            text_put(r, &r->path, "[", 1);
            text_put(r, &r->path, r->out.buf + key_at, key_len);
            text_put(r, &r->path, "]", 1);
        }
        out_s(r, ": ");
        rd_value(r, depth + 1);
        if (r->path.buf != NULL) {
            r->path.len = path_len;
            r->path.buf[path_len] = '\0';
        }
    }
    out_s(r, "}");
}

static void
rd_value(Reader *r, int depth)
{
    if (depth > MAX_READ_DEPTH) {
        r->malformed = 1;
        return;
    }
    unsigned char tag = rd_tag(r);
    switch (tag) {
    case TAG_NONE:
        out_s(r, "None");
        break;
    case TAG_FALSE:
        out_s(r, "False");
        break;
    case TAG_TRUE:
        out_s(r, "True");
        break;
    case TAG_INT:
        out_f(r, "%lld", (long long)rd_i64(r));
        break;
    case TAG_FLOAT: {
        double d = 0;
        rd(r, &d, sizeof(d));
        if (!r->describing) {
            break;
        }
        char *text = PyOS_double_to_string(d, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
        if (text == NULL) {
            r->no_memory = 1;
            break;
        }
        out_s(r, text);
        PyMem_Free(text);
        if (d != d) {
            /* every NaN reads "nan"; the key holds its bits */
            uint64_t bits;
            memcpy(&bits, &d, sizeof(bits));
            out_f(r, " (bits 0x%016llx)", (unsigned long long)bits);
        }
        break;
    }
    case TAG_STR: {
        int64_t size = rd_i64(r);
        if (size < 0 || size > r->end - r->p) {
            r->malformed = 1;
            break;
        }
        const char *utf8 = (const char *)r->p;
        r->p += size;
        if (!r->describing) {
            break;
        }
        /* str's own repr (C, no Python), of the characters the key holds */
        PyObject *s = PyUnicode_DecodeUTF8(utf8, (Py_ssize_t)size, "surrogatepass");
        PyObject *repr = s != NULL ? PyObject_Repr(s) : NULL;
        Py_ssize_t n = 0;
        const char *text = repr != NULL ? PyUnicode_AsUTF8AndSize(repr, &n) : NULL;
        if (text == NULL) {
            PyErr_Clear();
            out_s(r, "<str>");
        }
        else {
            text_put(r, &r->out, text, (size_t)n);
        }
        Py_XDECREF(repr);
        Py_XDECREF(s);
        break;
    }
    case TAG_TUPLE:
        rd_items(r, depth, "(", ")", 1);
        break;
    case TAG_LIST:
        rd_items(r, depth, "[", "]", 0);
        break;
    case TAG_DICT:
        rd_dict(r, depth, 0);
        break;
    case TAG_SHARED:
        out_f(r, "the same object as shared object #%lld", (long long)rd_i64(r));
        break;
    case TAG_STRUCT:
        out_pinned_type(r, rd_ptr(r));
        if (rd_tag(r) != TAG_DICT) {
            r->malformed = 1;
            break;
        }
        rd_dict(r, depth + 1, 1);
        break;
    case TAG_TENSOR:
    case TAG_TENSOR_META:
        rd_tensor(r, tag);
        break;
    case TAG_UNTRACKED: {
        unsigned char next = rd_tag(r);
        if (next != TAG_TENSOR && next != TAG_TENSOR_META) {
            r->malformed = 1;
            break;
        }
        rd_tensor(r, next);
        out_f(r, " (past the first %d tensors: aliasing not tracked)", CALL_KEY_MAX_ALIAS);
        break;
    }
    case TAG_ALIAS: {
        int64_t index = rd_i64(r);
        if (index < 0 || index >= r->n_tensors || index >= CALL_KEY_MAX_ALIAS) {
            r->malformed = 1;
            break;
        }
        if (r->describing && r->tensor_paths[index] != NULL) {
            out_f(r, "same tensor as %s", r->tensor_paths[index]);
        }
        else {
            out_f(r, "same tensor as tensor #%lld", (long long)index);
        }
        break;
    }
    case TAG_SUBTYPE: {
        out_pinned_type(r, rd_ptr(r));
        if (r->p < r->end && *r->p == TAG_TUPLE) {
            rd_value(r, depth + 1);   /* "(...)" after the type's name */
        }
        else {
            out_s(r, "(");
            rd_value(r, depth + 1);
            out_s(r, ")");
        }
        break;
    }
    case TAG_BUFFER: {
        const void *addr = rd_ptr(r);
        PyObject *type = rd_pinned(r, addr);
        int64_t size = rd_i64(r);
        if (size < 0 || size > r->end - r->p) {
            r->malformed = 1;
            break;
        }
        const unsigned char *bytes = r->p;
        r->p += size;
        if (type == NULL || !PyType_Check(type)) {
            out_f(r, "<NumPy scalar of a collected type at %p>(bytes %lld)", addr, (long long)size);
            break;
        }
        const char *name = type_name((PyTypeObject *)type);
        out_f(r, "%s(", name);
        out_numpy_value(r, name, bytes, size);
        out_s(r, ")");
        break;
    }
    case TAG_DEVICE:
        out_s(r, "device('");
        rd_device(r);
        out_s(r, "')");
        break;
    case TAG_OBJECT: {
        const void *type = rd_ptr(r);
        const void *addr = rd_ptr(r);
        PyObject *obj = rd_pinned(r, addr);
        if (obj == NULL) {
            out_f(r, "<object at %p, collected> (by identity)", addr);
        }
        else if ((const void *)Py_TYPE(obj) != type) {
            out_f(r, "<object at %p, its class since reassigned to %s> (by identity)", addr,
                  type_name(Py_TYPE(obj)));
        }
        else {
            out_f(r, "<%s object at %p> (by identity)", type_name(Py_TYPE(obj)), addr);
        }
        break;
    }
    default:
        r->malformed = 1;
    }
}

/* A reader over `data[0..len)`: describing (pins borrowed, or NULL: nothing is held or
 * dereferenced) or collecting the addresses the key pins. */
static void
reader_open(Reader *r, const unsigned char *data, size_t len, int describing, PyObject *pins)
{
    memset(r, 0, sizeof(*r));
    r->p = data;
    r->end = data + len;
    r->describing = describing;
    r->pins = pins;
}

static void
reader_free(Reader *r)
{
    PyMem_Free(r->out.buf);
    PyMem_Free(r->path.buf);
    for (Py_ssize_t i = 0; i < CALL_KEY_MAX_ALIAS; i++) {
        PyMem_Free(r->tensor_paths[i]);
    }
    for (Py_ssize_t i = 0; i < r->n_held; i++) {
        Py_DECREF(r->held[i]);   /* may run Python: last */
    }
    PyMem_Free(r->held);
}

static int
reader_error(Reader *r)
{
    if (r->no_memory) {
        PyErr_NoMemory();
        return -1;
    }
    if (r->malformed) {
        PyErr_SetString(PyExc_ValueError, "nnscaler: malformed call key");
        return -1;
    }
    return 0;
}

/* Reads the leading grad-mode element; its value, or -1 (malformed). */
static int
rd_grad(Reader *r)
{
    if (rd_tag(r) != TAG_GRAD) {
        r->malformed = 1;
        return -1;
    }
    unsigned char grad = rd_tag(r);
    if (grad != TAG_TRUE && grad != TAG_FALSE) {
        r->malformed = 1;
        return -1;
    }
    return grad == TAG_TRUE;
}

int
call_key_pin_from_bytes(CallKey *key)
{
    Reader r;
    reader_open(&r, key->data, key->len, 0, NULL);
    rd_grad(&r);
    /* Nothing below runs Python nor allocates a Python object: every address is
     * still the object the build read there, and is held before anything can run. */
    while (r.p < r.end && !r.malformed && !r.no_memory) {
        rd_value(&r, 0);
    }
    int err = reader_error(&r);
    key->flags |= CALL_KEY_PINS;
    for (Py_ssize_t i = 0; err == 0 && i < r.n_held; i++) {
        err = pin(key, r.held[i]);
    }
    reader_free(&r);
    return err;
}

PyObject *
call_key_describe(const unsigned char *data, size_t len, PyObject *pins, PyObject *names)
{
    Reader r;
    reader_open(&r, data, len, 1, pins);
    PyObject *lines = PyList_New(0);   /* owned */
    PyObject *result = NULL;
    if (lines == NULL) {
        return NULL;
    }
    int grad = rd_grad(&r);
    out_s(&r, grad ? "grad_mode: True" : "grad_mode: False");
    for (Py_ssize_t i = 0; !r.malformed && !r.no_memory; i++) {
        PyObject *line = PyUnicode_DecodeUTF8(r.out.buf ? r.out.buf : "", (Py_ssize_t)r.out.len,
                                              "replace");
        if (line == NULL || PyList_Append(lines, line) < 0) {
            Py_XDECREF(line);
            goto done;
        }
        Py_DECREF(line);
        if (r.p >= r.end) {
            break;
        }
        /* the next argument: "name: description", its path starting at its name */
        r.out.len = 0;
        r.path.len = 0;
        const char *name = NULL;
        Py_ssize_t name_len = 0;
        if (names != NULL && i < PyTuple_GET_SIZE(names) &&
            PyUnicode_Check(PyTuple_GET_ITEM(names, i))) {
            name = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(names, i), &name_len);
            if (name == NULL) {
                goto done;
            }
        }
        if (name != NULL) {
            text_put(&r, &r.path, name, (size_t)name_len);
        }
        else {
            char label[32];
            int n = snprintf(label, sizeof(label), "#%zd", i);
            text_put(&r, &r.path, label, (size_t)n);
        }
        text_put(&r, &r.out, r.path.buf ? r.path.buf : "", r.path.len);
        out_s(&r, ": ");
        rd_value(&r, 0);
    }
    if (reader_error(&r) == 0) {
        result = PyList_AsTuple(lines);
    }
done:
    Py_DECREF(lines);
    reader_free(&r);
    return result;
}

/* A field's layout item at `start` (a TAG_TENSOR_META, TAG_INT or TAG_FLOAT value),
 * with `path` (a tuple, borrowed) appended when not NULL.  New reference, or NULL
 * with r->malformed or an exception set. */
static PyObject *
field_item(Reader *r, const unsigned char *data, const unsigned char *start, PyObject *path)
{
    if (*start == TAG_TENSOR_META) {
        const size_t head = offsetof(NnsTensorMeta, sizes);
        NnsTensorMeta meta;
        if ((size_t)(r->end - start) < 1 + sizeof(void *) + head) {
            r->malformed = 1;
            return NULL;
        }
        memcpy(&meta, start + 1 + sizeof(void *), head);
        Py_ssize_t offset = (Py_ssize_t)(start - data) + 1 + (Py_ssize_t)(sizeof(void *) + head);
        return path != NULL ? Py_BuildValue("(snnO)", "tensor", offset, (Py_ssize_t)meta.ndim, path)
                            : Py_BuildValue("(snn)", "tensor", offset, (Py_ssize_t)meta.ndim);
    }
    const char *kind = *start == TAG_INT ? "int" : "float";
    Py_ssize_t offset = (Py_ssize_t)(start - data) + 1;
    return path != NULL ? Py_BuildValue("(snO)", kind, offset, path)
                        : Py_BuildValue("(sn)", kind, offset);
}

/* A str value of the key as a str object (new reference), or NULL when the value at
 * r->p is not a TAG_STR (nothing read) or on error (r->no_memory / malformed set). */
static PyObject *
rd_str_object(Reader *r)
{
    if (r->p >= r->end || *r->p != TAG_STR) {
        return NULL;
    }
    r->p++;
    int64_t size = rd_i64(r);
    if (r->malformed || size < 0 || size > r->end - r->p) {
        r->malformed = 1;
        return NULL;
    }
    PyObject *s = PyUnicode_DecodeUTF8((const char *)r->p, (Py_ssize_t)size, "surrogatepass");
    r->p += size;
    if (s == NULL) {
        r->no_memory = 1;
    }
    return s;
}

/* Walk one value, appending to `items` a field item for every tensor, int and float
 * inside a TAG_STRUCT, with its path (`path`: a list of steps, restored on return). */
static void
nested_walk(Reader *r, const unsigned char *data, PyObject *items, PyObject *path,
            int in_struct, int depth)
{
    if (depth > MAX_READ_DEPTH || r->p >= r->end) {
        r->malformed = 1;
        return;
    }
    const unsigned char *start = r->p;
    unsigned char tag = *start;
    if (in_struct && (tag == TAG_TENSOR_META || tag == TAG_INT || tag == TAG_FLOAT)) {
        PyObject *steps = PyList_AsTuple(path);
        PyObject *item = steps != NULL ? field_item(r, data, start, steps) : NULL;
        Py_XDECREF(steps);
        if (item == NULL || PyList_Append(items, item) < 0) {
            Py_XDECREF(item);
            if (!r->malformed) {
                r->no_memory = 1;
            }
            return;
        }
        Py_DECREF(item);
        r->out.len = 0;
        rd_value(r, depth);
        return;
    }
    if (tag != TAG_STRUCT && tag != TAG_LIST && tag != TAG_TUPLE && tag != TAG_DICT) {
        r->out.len = 0;
        rd_value(r, depth);
        return;
    }
    r->p++;
    if (tag == TAG_STRUCT) {
        rd_ptr(r);
        if (rd_tag(r) != TAG_DICT) {
            r->malformed = 1;
            return;
        }
    }
    int64_t n = rd_i64(r);
    if (r->malformed || n < 0 || n > r->end - r->p) {
        r->malformed = 1;
        return;
    }
    int pairs = tag == TAG_STRUCT || tag == TAG_DICT;
    for (int64_t i = 0; i < n && !r->malformed && !r->no_memory; i++) {
        PyObject *step;
        if (pairs) {
            PyObject *name = rd_str_object(r);
            if (name == NULL && (r->malformed || r->no_memory)) {
                return;
            }
            if (name == NULL && r->p < r->end && *r->p == TAG_INT && tag == TAG_DICT) {
                r->p++;
                name = PyLong_FromLongLong((long long)rd_i64(r));
            }
            else if (name == NULL) {
                r->out.len = 0;
                rd_value(r, depth + 1);   /* a key of another kind: its value is skipped */
                r->out.len = 0;
                rd_value(r, depth + 1);
                continue;
            }
            step = name != NULL ? Py_BuildValue("(sN)", tag == TAG_STRUCT ? "a" : "k", name)
                                : NULL;
        }
        else {
            step = Py_BuildValue("(sL)", "i", (long long)i);
        }
        if (step == NULL || PyList_Append(path, step) < 0) {
            Py_XDECREF(step);
            r->no_memory = 1;
            return;
        }
        Py_DECREF(step);
        nested_walk(r, data, items, path, in_struct || tag == TAG_STRUCT, depth + 1);
        if (PyList_SetSlice(path, PyList_GET_SIZE(path) - 1, PyList_GET_SIZE(path), NULL) < 0) {
            r->no_memory = 1;
            return;
        }
    }
}

/* The fields a dynamic entry may make symbolic, per top-level value (see
 * call_key.h).  Describing mode without pins: nothing is held or dereferenced. */
PyObject *
call_key_layout(const unsigned char *data, size_t len)
{
    Reader r;
    reader_open(&r, data, len, 1, NULL);
    PyObject *items = PyList_New(0);   /* owned */
    PyObject *result = NULL;
    if (items == NULL) {
        return NULL;
    }
    rd_grad(&r);
    while (r.p < r.end && !r.malformed && !r.no_memory) {
        const unsigned char *start = r.p;
        unsigned char tag = *start;
        PyObject *item = NULL;
        if (tag == TAG_TENSOR_META || tag == TAG_INT || tag == TAG_FLOAT) {
            item = field_item(&r, data, start, NULL);
            if (item == NULL && r.malformed) {
                break;
            }
        }
        else {
            item = Py_BuildValue("(sn)", "other", (Py_ssize_t)(start - data));
        }
        if (item == NULL || PyList_Append(items, item) < 0) {
            Py_XDECREF(item);
            goto done;
        }
        Py_DECREF(item);
        r.out.len = 0;
        rd_value(&r, 0);
    }
    if (reader_error(&r) == 0) {
        result = PyList_AsTuple(items);
    }
done:
    Py_DECREF(items);
    reader_free(&r);
    return result;
}

PyObject *
call_key_nested_layout(const unsigned char *data, size_t len)
{
    Reader r;
    reader_open(&r, data, len, 1, NULL);
    PyObject *items = PyList_New(0);   /* owned */
    PyObject *path = PyList_New(0);    /* owned */
    PyObject *result = NULL;
    if (items == NULL || path == NULL) {
        goto done;
    }
    rd_grad(&r);
    for (Py_ssize_t index = 0; r.p < r.end && !r.malformed && !r.no_memory; index++) {
        PyObject *top = PyLong_FromSsize_t(index);
        if (top == NULL || PyList_SetSlice(path, 0, PyList_GET_SIZE(path), NULL) < 0 ||
            PyList_Append(path, top) < 0) {
            Py_XDECREF(top);
            goto done;
        }
        Py_DECREF(top);
        nested_walk(&r, data, items, path, 0, 0);
    }
    if (PyErr_Occurred()) {
        goto done;
    }
    if (reader_error(&r) == 0) {
        result = PyList_AsTuple(items);
    }
done:
    Py_XDECREF(items);
    Py_XDECREF(path);
    reader_free(&r);
    return result;
}

/* ------------------------------------------------------- the CallKey object */

static int
key_object_traverse(CallKeyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->key.pins);
    return 0;
}

static int
key_object_clear(CallKeyObject *self)
{
    Py_CLEAR(self->key.pins);
    return 0;
}

static void
key_object_dealloc(CallKeyObject *self)
{
    PyObject_GC_UnTrack(self);
    call_key_release(&self->key);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
key_object_get_hash(CallKeyObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(call_key_hash(&self->key));
}

/* CallKey(*values): the key of a call with these argument values (what the miss path
 * builds for a frame's slots, `self` left out), in the current grad mode. */
static PyObject *
key_object_tp_new(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwds)
{
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "CallKey() takes no keyword arguments");
        return NULL;
    }
    if (guard_env.tensor_type == NULL || guard_env.is_grad_enabled == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "nnscaler_eval._C.install() has not run");
        return NULL;
    }
    CallKeyObject *self = call_key_object_new();
    if (self == NULL) {
        return NULL;
    }
    if (call_key_build(&self->key, PySequence_Fast_ITEMS(args), PyTuple_GET_SIZE(args)) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* key.rebuild(*values): build the key again, in place, for these values (the miss
 * path's key after the classes keyed by contents changed: call_key_set_struct_types).
 * On error the key is left as it was. */
static PyObject *
key_object_rebuild(CallKeyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CallKey fresh;
    call_key_init(&fresh, CALL_KEY_PINS);
    if (call_key_build(&fresh, args, nargs) < 0) {
        call_key_release(&fresh);
        return NULL;
    }
    call_key_move(&self->key, &fresh);
    call_key_release(&fresh);
    Py_RETURN_NONE;
}

static PyMethodDef key_object_methods[] = {
    {"rebuild", (PyCFunction)(void (*)(void))key_object_rebuild, METH_FASTCALL,
     "rebuild(*values): build the key again, in place, for these argument values."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef key_object_getset[] = {
    {"hash", (getter)key_object_get_hash, NULL, "XXH3 hash of the key (CacheEntry.key_hash)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject CallKey_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.CallKey",
    .tp_basicsize = sizeof(CallKeyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "CallKey(*values)\n\nThe per-call key of argument values, as the C miss path builds\n"
              "it for a frame's slots (and hands convert_frame); describe_call_key()\n"
              "describes it.",
    .tp_new = key_object_tp_new,
    .tp_dealloc = (destructor)key_object_dealloc,
    .tp_traverse = (traverseproc)key_object_traverse,
    .tp_clear = (inquiry)key_object_clear,
    .tp_getset = key_object_getset,
    .tp_methods = key_object_methods,
};

CallKeyObject *
call_key_object_new(void)
{
    CallKeyObject *self = PyObject_GC_New(CallKeyObject, &CallKey_Type);
    if (self == NULL) {
        return NULL;
    }
    call_key_init(&self->key, CALL_KEY_PINS);
    PyObject_GC_Track(self);
    return self;
}
