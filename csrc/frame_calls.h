/* frame_calls.h - running a frame's code other ways than as the frame it is: on
 * CPython's own evaluator, as its rewritten code, or as a call with its argument
 * slots.  Used by the hook (eval_frame.c) and by capture dispatch (dispatch.c); the
 * region a frame runs under is the caller's business (arming.h): nothing here arms
 * or disarms.
 */
#ifndef NNSCALER_FRAME_CALLS_H
#define NNSCALER_FRAME_CALLS_H

#include "compat.h"
#include "code_state.h"

/* Frames we do not replace run on CPython's own evaluator, never on the evaluator
 * that was installed before us: that one may be Dynamo's shim, which hands frames
 * back to whatever the interpreter's eval_frame is (us), and after Dynamo swapped
 * evaluators underneath an armed region the two called each other forever.
 * Dynamo installs its shim itself whenever it runs compiled code, so it needs
 * nothing from a chain; the previous evaluator is only restored on disarm.
 * Inline: the hook's every frame not replaced ends here.  New reference, NULL on
 * error.  Runs Python (the frame). */
static inline PyObject *
frame_run_default(PyThreadState *ts, NnsFrame *frame, int throw_flag)
{
    return nns_eval_frame_default(ts, frame, throw_flag);
}

/* Runs the rewritten code of `cs` (cs->rewritten, not NULL) in place of the frame's
 * own code; the frame's own code when the frame has no function object, or when
 * making the function failed (reported as a warning).  New reference, NULL on error.
 * Runs Python (the frame). */
PyObject *frame_run_rewritten(PyThreadState *ts, NnsFrame *frame, CodeState *cs,
                              int throw_flag);

/* Runs `code` (borrowed; same parameters, cells and free variables as the frame's
 * own code) in place of the frame's code, as frame_run_rewritten does.  New
 * reference, NULL on error.  Runs Python (the frame). */
PyObject *frame_run_code(PyThreadState *ts, NnsFrame *frame, PyObject *code, int throw_flag);

/* Evaluate the frame (its rewritten code if any) with the current region: used by
 * dispatch.c to run a target eagerly, the hook still armed so that the forwards it
 * calls are intercepted.  New reference, NULL on error.  Runs Python (the frame). */
PyObject *frame_run_eagerly(PyThreadState *ts, NnsFrame *frame, CodeState *cs);

/* Calls `callable` with the frame-style argument slots of `code` rebound as a
 * normal call: positional parameters, *args items, keyword-only parameters and
 * **kwargs items.  New reference, NULL on error.  Runs Python (the callee). */
PyObject *call_with_slots(PyObject *callable, PyCodeObject *code, PyObject *const *slots);

/* Number of argument slots of `code`: parameters, plus *args and **kwargs. */
Py_ssize_t code_arg_slots(PyCodeObject *code);

/* A new function running `code` with the globals and closure of `func`.  New reference.
 * Runs no Python code. */
PyObject *function_with_code(PyObject *func, PyObject *code);

#endif
