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
 * ValueError naming `what` and both sizes otherwise).  0, or -1 with an exception. */
int nns_replay_copy(PyObject *dst, PyObject *src, const char *what);

/* `t.clone()` (same strides where dense, else contiguous) under no_grad: a new
 * reference, or NULL with an exception. */
PyObject *nns_replay_clone(PyObject *t);

/* The view `t[:n0, :n1, ...]` of the leading positions for `sizes` (a tuple of ints,
 * one per dimension of t, each at most t's; a ValueError naming `what` otherwise): a
 * new reference sharing t's memory, or NULL with an exception. */
PyObject *nns_replay_leading(PyObject *t, PyObject *sizes, const char *what);

#ifdef __cplusplus
}
#endif

#endif
