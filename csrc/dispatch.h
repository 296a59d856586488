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

#endif
