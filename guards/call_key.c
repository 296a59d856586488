/* call_key.c - encoding the per-call key (the hit path builds one per call) and
 * hashing it with XXH3; the CallKey object that holds a key for Python.  The bytes
 * are laid out in call_key_format.h and read back by call_key_reader.c only. */
#include "call_key.h"
#include "call_key_format.h"
#include "guard_env.h"
#include "tensor_meta.h"

#include <stddef.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

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

int
call_key_pin(CallKey *key, PyObject *obj)
{
    return pin_stored(key, obj);
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
