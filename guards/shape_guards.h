/* shape_guards.h - what a dynamic entry checks of its call key: symbolic sizes.
 *
 * An entry captured with some tensor dimensions (or int arguments) symbolic matches
 * any key that equals its stored key everywhere but in those slots: the 8-byte
 * fields of the key that hold a symbolic size, a stride of a tensor with a symbolic
 * size, or an int argument made symbolic (`wild`).  What the graph assumed of them
 * is a small program over those fields, run on the new key: each CHECK pops a value
 * that must be nonzero (a range, an equality between dimensions, a divisibility, a
 * stride as an expression of sizes, a decision Python took on a size).
 *
 * The program is stack code on int64 (Python's semantics for // and %); it is
 * validated once when it is set (opcodes, slot offsets, stack depth), so the hit
 * path runs it without checks beyond arithmetic: an overflow or a division by zero
 * fails the match (the call recaptures), never a wrong answer.  Runs no Python.
 */
#ifndef NNSCALER_SHAPE_GUARDS_H
#define NNSCALER_SHAPE_GUARDS_H

#include "compat_objects.h"
#include <stdint.h>

/* Opcodes; each is one int64 of the program, LOAD and CONST take one operand. */
enum {
    SG_LOAD = 1,    /* push the int64 at key offset <operand> */
    SG_CONST,       /* push <operand> */
    SG_ADD, SG_SUB, SG_MUL, SG_FLOORDIV, SG_MOD, SG_POW, SG_NEG,
    SG_MAX, SG_MIN,
    SG_EQ, SG_NE, SG_LT, SG_LE, SG_GT, SG_GE,
    SG_AND, SG_OR, SG_NOT,
    SG_CHECK,       /* pop; zero: the key does not match */
    /* Fused checks (what most guards are), two operands each, the stack untouched:
     * the field at key offset <a> compared with the constant or field <b>. */
    SG_CHECK_GE_CONST, SG_CHECK_LE_CONST, SG_CHECK_EQ_CONST, SG_CHECK_EQ_LOAD,
    SG_N_OPS
};

#define SHAPE_GUARDS_MAX_STACK 64

typedef struct {
    Py_ssize_t n_wild;
    int64_t *wild;            /* sorted key offsets of the 8-byte symbolic fields */
    unsigned char *mask;      /* key_len bytes: 0x00 in the symbolic fields, else 0xff */
    Py_ssize_t n_code;
    int64_t *code;            /* the validated program, as it was set */
    size_t key_len;           /* the length every matching key has */
    /* The program as run: fused checks leave the stack alone, so they run first, in
     * tight loops of their own (most guards: strides and equal dimensions), then
     * what is left of the stack code.  Same verdict as `code` in order. */
    Py_ssize_t n_equal;       /* SG_CHECK_EQ_LOAD: offset pairs */
    int64_t *equal;
    Py_ssize_t n_bound;       /* SG_CHECK_{GE,LE,EQ}_CONST: (opcode, offset, constant) */
    int64_t *bound;
    Py_ssize_t n_rest;        /* the stack code without the fused checks */
    int64_t *rest;
} ShapeGuards;

/* Validated guards from `wild` (a list or tuple of int offsets) and `code` (a list or
 * tuple of int), for keys of `key_len` bytes.  NULL with ValueError naming what is
 * wrong.  Runs Python: the items' __index__ (both are read from tuple snapshots). */
ShapeGuards *shape_guards_new(PyObject *wild, PyObject *code, size_t key_len);
void shape_guards_free(ShapeGuards *guards);

/* 1 when `key` (len bytes) equals `stored` outside the symbolic fields and the
 * program holds on it, else 0.  Runs no Python, never raises. */
int shape_guards_match(const ShapeGuards *guards, const unsigned char *stored,
                       const unsigned char *key, size_t len);

/* The program's verdict on a key alone (tests): 1, 0.  Never raises. */
int shape_guards_run(const ShapeGuards *guards, const unsigned char *key);

#endif
