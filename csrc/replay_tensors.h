/* replay_tensors.h - the three tensor operations a recorded graph's replay needs,
 * through torch's C++ API (replay_tensors.cpp): no Python frame, no argument parsing,
 * no `__torch_function__` (the copies and clones are the replay's bookkeeping, not the
 * user's computation).  Built without torch's headers (NNS_NO_TORCH_HEADERS), each
 * calls the tensor's Python method instead.
 *
 * Every function takes plain torch.Tensor / nn.Parameter objects (the caller checks
 * nothing else reaches it: a tensor subclass fails with TypeError), runs under
 * no_grad, and turns a C++ error into a Python exception. */
#ifndef NNSCALER_REPLAY_TENSORS_H
#define NNSCALER_REPLAY_TENSORS_H

#include <Python.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when `a` and `b` are views of the same memory with the same layout: data
 * pointer, sizes, strides, dtype and device all equal (copying one into the other
 * would be a no-op); 0 when not; -1 with an exception when either is not a tensor
 * or has no memory (a meta or fake tensor). */
int nns_replay_same_memory(PyObject *a, PyObject *b);

/* `dst.copy_(src)` under no_grad, refusing a broadcast: sizes must be equal (a
 * ValueError naming `what` and both sizes otherwise).  With `prefix`, `src` may be
 * smaller than `dst` along any dimension (not in number of dimensions): it is copied
 * into the leading positions of each (`dst[:n0, :n1, ...]`), the rest of `dst` left
 * as it is.  0, or -1 with an exception. */
int nns_replay_copy(PyObject *dst, PyObject *src, const char *what, int prefix);

/* `t.clone()` (same strides where dense) under no_grad: a new reference, or NULL
 * with an exception.  With `sizes` (a tuple of ints, one per dimension, each at most
 * t's; NULL for all of t) the clone is of the leading positions only
 * (`t[:n0, :n1, ...]`), contiguous where those are not dense. */
PyObject *nns_replay_clone(PyObject *t, PyObject *sizes);

#ifdef __cplusplus
}
#endif

#endif
