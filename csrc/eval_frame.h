/* eval_frame.h - the PEP 523 hook and per-thread arming.
 *
 * The hook is installed only while at least one thread is armed (a reference count
 * of armed threads); whatever evaluator was installed before is restored when the
 * count drops to zero, so Python code outside armed regions runs on CPython's own
 * evaluator with all its specialisations.
 *
 * A thread is armed with a *config*: the rewrite-mode sentinel (run rewritten code),
 * or a capture config (a Python object handed to convert_frame on a miss).  Arming
 * nests; each arm_push is matched by one arm_pop with the same ArmSaved.
 */
#ifndef NNSCALER_EVAL_FRAME_H
#define NNSCALER_EVAL_FRAME_H

#include "compat.h"

typedef struct {
    PyObject *config;       /* owned by the saved record while pushed */
    PyObject *target;       /* owned: code object captured even if not a forward */
} ArmSaved;

/* Arm this thread with `config` (borrowed; NULL or None disarms, as in disable())
 * and an optional target code (borrowed, may be NULL). Never fails. */
void arm_push(ArmSaved *saved, PyObject *config, PyObject *target);
/* Restore what arm_push saved. Never fails. */
void arm_pop(ArmSaved *saved);

/* Borrowed: this thread's current config, or NULL. */
PyObject *arm_current_config(void);
/* 1 while the hook is installed in this interpreter. */
int eval_frame_installed(void);
/* Number of threads armed right now. */
Py_ssize_t eval_frame_armed_threads(void);

/* Calls `callable` with the frame-style argument slots of `code` rebound as a
 * normal call: positional parameters, *args items, keyword-only parameters and
 * **kwargs items.  New reference, NULL on error. */
PyObject *call_with_slots(PyObject *callable, PyCodeObject *code, PyObject *const *slots);

/* Number of argument slots of `code`: parameters, plus *args and **kwargs. */
Py_ssize_t code_arg_slots(PyCodeObject *code);

/* A new function running `code` with the globals and closure of `func`. New ref. */
PyObject *function_with_code(PyObject *func, PyObject *code);

#endif
