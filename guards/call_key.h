/* call_key.h - guard kind 1: the per-call key.
 *
 * A byte string describing everything about a call that the captured graph was
 * specialised on: grad mode, and for each argument slot its type and, for tensors,
 * dtype, device, shape, strides and requires_grad; for non-tensor values their
 * value (None/bool/int/float/str, recursively through tuples, lists and dicts) or,
 * for any other object, its identity.  Hashed with XXH3; a hit compares the stored
 * bytes in full.  The identity of `self` is not in the key: entries are grouped per
 * `self` in a CacheBucket.
 */
#ifndef NNSCALER_CALL_KEY_H
#define NNSCALER_CALL_KEY_H

#include "compat.h"

#define CALL_KEY_INLINE 512

typedef struct {
    unsigned char *data;        /* points at inline_buf or a PyMem block */
    size_t len, cap;
    uint64_t hash;
    PyObject *pins;             /* owned list or NULL: objects keyed by identity */
    int collect_pins;           /* set before building a key that will be stored */
    unsigned char inline_buf[CALL_KEY_INLINE];
} CallKey;

void call_key_init(CallKey *key, int collect_pins);
void call_key_release(CallKey *key);

/* Encode `values[0..n)` (borrowed) and hash. 0, or -1 with an exception set. Calls
 * tensor attribute getters (may run Python for tensor subclasses). */
int call_key_build(CallKey *key, PyObject *const *values, Py_ssize_t n);

#endif
