/* call_key_reader.c - the one reader of a per-call key's bytes (call_key_format.h):
 * the key in words for logs and explain() (call_key_describe), the pins of a key
 * built without them (call_key_pin_from_bytes), and where a dynamic entry's
 * symbolic fields lie (call_key_layout, call_key_nested_layout; capture/dynamic.py).
 * None of it is on the hit path. */
#include "call_key_reader.h"
#include "call_key_format.h"
#include "tensor_meta.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

/* ---------------------------------------------------------------- decoding
 *
 * One reader of the bytes call_key.c puts, for two uses: describing a key in words,
 * and collecting the addresses a key pins (in the order the encoder's pin() met them,
 * which is the order of their bytes).  It reads the bytes and, where the key pins an address, the pin;
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
        err = call_key_pin(key, r.held[i]);
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
 * call_key_reader.h).  Describing mode without pins: nothing is held or dereferenced. */
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
