/* call_key.h - guard kind 1: the per-call key.
 *
 * A byte string describing everything about a call that the captured graph was
 * specialised on: grad mode, and for each argument slot its type and, for tensors,
 * dtype, device, shape, strides and requires_grad, or the index of the same tensor
 * met earlier in the key (aliased inputs); for non-tensor values their value
 * (None/bool/int/float/str, recursively through tuples, lists and dicts; torch.Size,
 * named tuples, NumPy scalars and torch.device by value too) or, for any other
 * object, its identity (see pin() in call_key.c).  Hashed with XXH3; a hit compares the stored
 * bytes in full.  The identity of `self` is not in the key: entries are grouped per
 * `self` in a CacheBucket.
 */
#ifndef NNSCALER_CALL_KEY_H
#define NNSCALER_CALL_KEY_H

#include "compat.h"

#define CALL_KEY_INLINE 512
#define CALL_KEY_MAX_ALIAS 64   /* tensors tracked for aliasing in one key */

typedef struct {
    unsigned char *data;        /* points at inline_buf or a PyMem block */
    size_t len, cap;
    uint64_t hash;
    PyObject *pins;             /* owned list or NULL: objects keyed by identity */
    int collect_pins;           /* set before building a key that will be stored */
    Py_ssize_t n_tensors;       /* tensors put so far */
    void *tensors[CALL_KEY_MAX_ALIAS];   /* their addresses (alias detection only) */
    unsigned char inline_buf[CALL_KEY_INLINE];
} CallKey;

void call_key_init(CallKey *key, int collect_pins);
void call_key_release(CallKey *key);

/* Encode `values[0..n)` (borrowed; the caller keeps them alive) and hash. 0, or -1
 * with an exception set.  May run Python: tensor attribute getters (tensor
 * subclasses), hashes of torch.device; containers are walked through owned
 * snapshots, so such code cannot free what the walk holds. */
int call_key_build(CallKey *key, PyObject *const *values, Py_ssize_t n);

#endif
