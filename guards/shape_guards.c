/* shape_guards.c - see shape_guards.h. */
#include "shape_guards.h"
#include <string.h>

/* The ints of `seq`, read from a tuple snapshot: an item's __index__ may run Python
 * that changes `seq` (a list) under the loop. */
static int
read_int64s(PyObject *seq, const char *what, int64_t **out, Py_ssize_t *n_out)
{
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "%s, not %.100s", what, Py_TYPE(seq)->tp_name);
        return -1;
    }
    PyObject *fast = PySequence_Tuple(seq);
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(fast);
    int64_t *v = PyMem_Malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    if (v == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long x = PyLong_AsLongLong(PyTuple_GET_ITEM(fast, i));
        if (x == -1 && PyErr_Occurred()) {
            PyMem_Free(v);
            Py_DECREF(fast);
            return -1;
        }
        v[i] = (int64_t)x;
    }
    Py_DECREF(fast);
    *out = v;
    *n_out = n;
    return 0;
}

static int
bad(const char *fmt, Py_ssize_t at)
{
    PyErr_Format(PyExc_ValueError, fmt, at);
    return -1;
}

/* Offsets inside the key, operands present, the stack never under- or overflows,
 * and empty at the end (every value checked). */
static int
validate(const ShapeGuards *g)
{
    for (Py_ssize_t i = 0; i < g->n_wild; i++) {
        if (g->wild[i] < 0 || (size_t)g->wild[i] + 8 > g->key_len) {
            return bad("shape guards: symbolic field %zd lies outside the key", i);
        }
        if (i > 0 && g->wild[i] < g->wild[i - 1] + 8) {
            return bad("shape guards: symbolic field %zd is not sorted apart from the "
                       "one before", i);
        }
    }
    Py_ssize_t depth = 0;
    for (Py_ssize_t pc = 0; pc < g->n_code; pc++) {
        int64_t op = g->code[pc];
        switch (op) {
        case SG_LOAD:
        case SG_CONST:
            if (pc + 1 >= g->n_code) {
                return bad("shape guards: opcode at %zd lacks its operand", pc);
            }
            if (op == SG_LOAD &&
                (g->code[pc + 1] < 0 || (size_t)g->code[pc + 1] + 8 > g->key_len)) {
                return bad("shape guards: LOAD at %zd reads outside the key", pc);
            }
            pc++;
            depth++;
            break;
        case SG_CHECK_GE_CONST:
        case SG_CHECK_LE_CONST:
        case SG_CHECK_EQ_CONST:
        case SG_CHECK_EQ_LOAD:
            if (pc + 2 >= g->n_code) {
                return bad("shape guards: fused check at %zd lacks its operands", pc);
            }
            if (g->code[pc + 1] < 0 || (size_t)g->code[pc + 1] + 8 > g->key_len ||
                (op == SG_CHECK_EQ_LOAD &&
                 (g->code[pc + 2] < 0 || (size_t)g->code[pc + 2] + 8 > g->key_len))) {
                return bad("shape guards: fused check at %zd reads outside the key", pc);
            }
            pc += 2;
            break;
        case SG_NEG:
        case SG_NOT:
            if (depth < 1) {
                return bad("shape guards: stack underflow at %zd", pc);
            }
            break;
        case SG_CHECK:
            if (depth < 1) {
                return bad("shape guards: stack underflow at %zd", pc);
            }
            depth--;
            break;
        default:
            if (op < SG_ADD || op >= SG_N_OPS) {
                return bad("shape guards: unknown opcode at %zd", pc);
            }
            if (depth < 2) {
                return bad("shape guards: stack underflow at %zd", pc);
            }
            depth--;
            break;
        }
        if (depth > SHAPE_GUARDS_MAX_STACK) {
            return bad("shape guards: stack deeper than 64 at %zd", pc);
        }
    }
    if (depth != 0) {
        return bad("shape guards: %zd values left unchecked", depth);
    }
    return 0;
}

/* `equal`, `bound` and `rest` from the validated `code` (see ShapeGuards). */
static int
split(ShapeGuards *g)
{
    size_t n = (size_t)(g->n_code ? g->n_code : 1);
    g->equal = PyMem_Malloc(sizeof(int64_t) * n);
    g->bound = PyMem_Malloc(sizeof(int64_t) * n);   /* each part holds at most the code */
    g->rest = PyMem_Malloc(sizeof(int64_t) * n);
    if (g->equal == NULL || g->bound == NULL || g->rest == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t pc = 0; pc < g->n_code; pc++) {
        int64_t op = g->code[pc];
        if (op == SG_CHECK_EQ_LOAD) {
            g->equal[g->n_equal++] = g->code[pc + 1];
            g->equal[g->n_equal++] = g->code[pc + 2];
            pc += 2;
        }
        else if (op >= SG_CHECK_GE_CONST) {
            g->bound[g->n_bound++] = op;
            g->bound[g->n_bound++] = g->code[pc + 1];
            g->bound[g->n_bound++] = g->code[pc + 2];
            pc += 2;
        }
        else {
            g->rest[g->n_rest++] = op;
            if (op == SG_LOAD || op == SG_CONST) {
                g->rest[g->n_rest++] = g->code[++pc];
            }
        }
    }
    return 0;
}

ShapeGuards *
shape_guards_new(PyObject *wild, PyObject *code, size_t key_len)
{
    ShapeGuards *g = PyMem_Calloc(1, sizeof(ShapeGuards));
    if (g == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    g->key_len = key_len;
    if (read_int64s(wild, "shape guards: wild must be a list or tuple", &g->wild, &g->n_wild) < 0 ||
        read_int64s(code, "shape guards: code must be a list or tuple", &g->code, &g->n_code) < 0 ||
        validate(g) < 0) {
        shape_guards_free(g);
        return NULL;
    }
    if (split(g) < 0) {
        shape_guards_free(g);
        return NULL;
    }
    g->mask = PyMem_Malloc(key_len ? key_len : 1);
    if (g->mask == NULL) {
        shape_guards_free(g);
        PyErr_NoMemory();
        return NULL;
    }
    memset(g->mask, 0xff, key_len);
    for (Py_ssize_t i = 0; i < g->n_wild; i++) {
        memset(g->mask + g->wild[i], 0, 8);
    }
    return g;
}

void
shape_guards_free(ShapeGuards *g)
{
    if (g != NULL) {
        PyMem_Free(g->wild);
        PyMem_Free(g->mask);
        PyMem_Free(g->code);
        PyMem_Free(g->equal);
        PyMem_Free(g->bound);
        PyMem_Free(g->rest);
        PyMem_Free(g);
    }
}

static inline int64_t
load(const unsigned char *key, int64_t offset)
{
    int64_t v;
    memcpy(&v, key + offset, sizeof(v));
    return v;
}

/* Python's floor division and modulo; 0 when undefined or overflowing (*ok = 0). */
static inline int64_t
floordiv(int64_t a, int64_t b, int *ok)
{
    if (b == 0 || (a == INT64_MIN && b == -1)) {
        *ok = 0;
        return 0;
    }
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) {
        q--;
    }
    return q;
}

static inline int64_t
pymod(int64_t a, int64_t b, int *ok)
{
    if (b == 0 || (a == INT64_MIN && b == -1)) {
        *ok = 0;
        return 0;
    }
    int64_t r = a % b;
    if (r != 0 && ((r < 0) != (b < 0))) {
        r += b;
    }
    return r;
}

static inline int64_t
ipow(int64_t a, int64_t e, int *ok)
{
    if (e < 0) {
        *ok = 0;
        return 0;
    }
    int64_t r = 1;
    while (e-- > 0) {
        if (__builtin_mul_overflow(r, a, &r)) {
            *ok = 0;
            return 0;
        }
    }
    return r;
}

int
shape_guards_run(const ShapeGuards *g, const unsigned char *key)
{
    for (Py_ssize_t i = 0; i < g->n_equal; i += 2) {
        if (load(key, g->equal[i]) != load(key, g->equal[i + 1])) {
            return 0;
        }
    }
    for (Py_ssize_t i = 0; i < g->n_bound; i += 3) {
        int64_t op = g->bound[i], a = load(key, g->bound[i + 1]), b = g->bound[i + 2];
        if (op == SG_CHECK_GE_CONST ? a < b : op == SG_CHECK_LE_CONST ? a > b : a != b) {
            return 0;
        }
    }
    int64_t stack[SHAPE_GUARDS_MAX_STACK + 1];
    Py_ssize_t sp = 0;
    int ok = 1;
    const int64_t *code = g->rest;
    for (Py_ssize_t pc = 0; pc < g->n_rest; pc++) {
        int64_t op = code[pc];
        if (op == SG_LOAD) {
            stack[sp++] = load(key, code[++pc]);
            continue;
        }
        if (op == SG_CONST) {
            stack[sp++] = code[++pc];
            continue;
        }
        if (op == SG_CHECK) {
            if (stack[--sp] == 0) {
                return 0;
            }
            continue;
        }
        if (op == SG_NEG) {
            if (stack[sp - 1] == INT64_MIN) {
                return 0;
            }
            stack[sp - 1] = -stack[sp - 1];
            continue;
        }
        if (op == SG_NOT) {
            stack[sp - 1] = !stack[sp - 1];
            continue;
        }
        int64_t b = stack[--sp];
        int64_t a = stack[sp - 1];
        int64_t r = 0;
        switch (op) {
        case SG_ADD: ok = !__builtin_add_overflow(a, b, &r); break;
        case SG_SUB: ok = !__builtin_sub_overflow(a, b, &r); break;
        case SG_MUL: ok = !__builtin_mul_overflow(a, b, &r); break;
        case SG_FLOORDIV: r = floordiv(a, b, &ok); break;
        case SG_MOD: r = pymod(a, b, &ok); break;
        case SG_POW: r = ipow(a, b, &ok); break;
        case SG_MAX: r = a > b ? a : b; break;
        case SG_MIN: r = a < b ? a : b; break;
        case SG_EQ: r = a == b; break;
        case SG_NE: r = a != b; break;
        case SG_LT: r = a < b; break;
        case SG_LE: r = a <= b; break;
        case SG_GT: r = a > b; break;
        case SG_GE: r = a >= b; break;
        case SG_AND: r = a && b; break;
        case SG_OR: r = a || b; break;
        default: ok = 0; break;
        }
        if (!ok) {
            return 0;
        }
        stack[sp - 1] = r;
    }
    return 1;
}

int
shape_guards_match(const ShapeGuards *g, const unsigned char *stored,
                   const unsigned char *key, size_t len)
{
    if (len != g->key_len) {
        return 0;
    }
    /* Equal outside the symbolic fields: word by word under the mask, the
     * differences gathered without a branch per word (a mismatch is the rare case). */
    uint64_t differ = 0;
    size_t at = 0;
    for (; at + 16 <= len; at += 16) {
        uint64_t k0, s0, m0, k1, s1, m1;
        memcpy(&k0, key + at, 8);
        memcpy(&s0, stored + at, 8);
        memcpy(&m0, g->mask + at, 8);
        memcpy(&k1, key + at + 8, 8);
        memcpy(&s1, stored + at + 8, 8);
        memcpy(&m1, g->mask + at + 8, 8);
        differ |= ((k0 ^ s0) & m0) | ((k1 ^ s1) & m1);
    }
    for (; at < len; at++) {
        differ |= (uint64_t)((key[at] ^ stored[at]) & g->mask[at]);
    }
    return differ == 0 && shape_guards_run(g, key);
}
