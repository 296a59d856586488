/* dispatch.h - capture mode: guards -> cache -> runner, or convert_frame on a miss. */
#ifndef NNSCALER_DISPATCH_H
#define NNSCALER_DISPATCH_H

#include "compat.h"
#include "code_state.h"

/* Runs a target frame in capture mode.  `self` (borrowed) is the module for a
 * forward, NULL for a compiled function (the frame's function object owns the
 * cache bucket then: closures of one code object do not share entries); `config`
 * (borrowed) the region's capture config: buckets are kept per config too, so a
 * function or module compiled again with another backend gets its own entries.
 * Returns the frame's result (new reference) or NULL with an exception.
 * Runs Python: tensor-subclass getters while building the key, training
 * properties while checking guards, the runner, convert_frame on a miss; every
 * object it uses across those is held by a strong reference. */
PyObject *dispatch_capture(PyThreadState *ts, NnsFrame *frame, PyCodeObject *code,
                           CodeState *cs, PyObject *self, PyObject *config);

/* A hit without the forward's frame, for a compiled module called with positional
 * arguments only (compiled_call.c): `slots` are what the frame's argument slots
 * would hold (`self` first, borrowed, kept alive by the caller), the thread armed
 * with `config`.  1 with *result set (the runner's value, or NULL with its
 * exception) when it was a hit; 0 when the call must take the frame path, having run
 * nothing that path does not run again but the key's reads and the guards' (the
 * caller passes only exact tensors, whose reads run no Python).  Counts the hit as
 * the frame path would. */
int dispatch_hit_by_slots(CodeState *cs, PyObject *config, PyObject *self,
                          PyObject *const *slots, Py_ssize_t n, PyObject **result);

#endif
