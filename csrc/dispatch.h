/* dispatch.h - capture mode: guards -> cache -> runner, or convert_frame on a miss. */
#ifndef NNSCALER_DISPATCH_H
#define NNSCALER_DISPATCH_H

#include "compat.h"
#include "code_state.h"

/* Runs a target frame in capture mode.  `self` (borrowed) is the module for a
 * forward, NULL for a compiled function; `config` (borrowed) the thread's capture
 * config.  Returns the frame's result (new reference) or NULL with an exception. */
PyObject *dispatch_capture(PyThreadState *ts, NnsFrame *frame, PyCodeObject *code,
                           CodeState *cs, PyObject *self, PyObject *config);

/* From eval_frame.c. */
PyObject *eval_frame_run_eagerly(PyThreadState *ts, NnsFrame *frame, CodeState *cs);
PyObject *eval_frame_suspend(void);
void eval_frame_resume(PyObject *config);

#endif
