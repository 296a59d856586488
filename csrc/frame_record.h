/* frame_record.h - which functions ran on this thread during a capture.
 *
 * The capture's value guards need the code that ran (its names, globals, closure
 * cells).  The frame evaluator sees every frame of an armed thread, so it notes each
 * frame's function while recording is on: no profile function (which would displace
 * the user's profiler, cProfile included) and no cost but one thread-local load per
 * frame when off.
 */
#ifndef NNSCALER_FRAME_RECORD_H
#define NNSCALER_FRAME_RECORD_H

#include "compat.h"

/* Owned set of function objects, or NULL when this thread is not recording.  Set
 * only through frame_record_replace. */
extern _Thread_local PyObject *frame_record_set;
/* How many threads have a set now (protected by the GIL): while none has, the
 * evaluator's every frame tests this global and reads no thread-local. */
extern Py_ssize_t frame_record_threads;

/* 1 when this thread is recording.  Runs no Python. */
static inline int
frame_record_active(void)
{
    return frame_record_threads != 0 && frame_record_set != NULL;
}

/* Put `set` (a new reference moved in, or NULL) in this thread's slot; the set it
 * held (owned, or NULL) is returned to the caller.  Runs no Python. */
PyObject *frame_record_replace(PyObject *set);

/* Note the function of `frame` (called by the evaluator while frame_record_set is
 * not NULL).  Never raises: a failed insertion is dropped (the set may then be
 * incomplete, so it is marked incomplete and the capture is not cached).  May run
 * Python (set growth can trigger GC finalizers); it holds nothing across that. */
void frame_record_note(NnsFrame *frame);

/* record_functions(on) -> previous set or None: `on` true starts recording into a
 * new set (returning the one being recorded into, to be restored later); false
 * stops.  Python functions of _C (module.c); these and the two below return a new
 * reference, NULL with an exception set. */
PyObject *frame_record_start(PyObject *module, PyObject *noargs);
PyObject *frame_record_stop(PyObject *module, PyObject *previous);
/* record_functions_pause() -> token: no recording until record_functions_resume(token)
 * (code run for real but not traced, such as hooks of opaque modules, shapes no
 * graph and must not be guarded). */
PyObject *frame_record_pause(PyObject *module, PyObject *noargs);
PyObject *frame_record_resume(PyObject *module, PyObject *paused);

#endif
