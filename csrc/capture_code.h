/* capture_code.h - code run in place of the user's while a capture records.
 *
 * A capture converts `if` statements on tensors into torch.cond and `while` loops on
 * tensors into while_loop (nnscaler_eval/capture/branches.py).  For that, frames of
 * user code started while a capture records run a version of their code with hooks at
 * each `if` and loop test (the capture
 * flavour), and frames started while one side of such an `if` is traced on fake
 * tensors run a version that checks every side effect (the checked flavour).  Which
 * version, and whether any, is decided in Python once per code object and flavour
 * (nns_globals.capture_code, `capture_code(function, code, checked)` -> code or
 * None) and kept in the code's CodeState; the tracer sets the mode per thread.
 */
#ifndef NNSCALER_CAPTURE_CODE_H
#define NNSCALER_CAPTURE_CODE_H

#include "compat.h"
#include "code_state.h"

/* This thread's mode: 0 off, 1 the capture flavour, 2 the checked flavour. */
extern _Thread_local int capture_code_mode;
/* Threads whose mode is not 0 (protected by the GIL): while none is, the evaluator's
 * fast path reads no thread-local for this. */
extern Py_ssize_t capture_code_threads;

static inline int
capture_code_active(void)
{
    return capture_code_threads != 0 && capture_code_mode != 0;
}

/* 1 when a frame of `cs`'s code may run other code in this thread's mode (decided
 * to, or not decided yet).  Runs no Python. */
static inline int
capture_code_wanted(const CodeState *cs)
{
    if (!capture_code_active() || (cs->flags & CS_CAPTURE_CODE)) {
        return 0;
    }
    int checked = capture_code_mode == 2;
    return !cs->capture_known[checked] || cs->capture_code[checked] != NULL;
}

/* The code a frame of `code` runs in this thread's mode: *alt set to it (borrowed from
 * `cs`, which the code object owns) or to NULL (run the frame as it is).  Returns 0,
 * or -1 with an exception set when the frame must raise it: in the checked mode, the
 * decision refused the code (a side effect that cannot be checked).  Errors of the
 * decision in the capture mode become a warning (the frame runs as it is).
 * Runs Python (the decision). */
int capture_code_for(NnsFrame *frame, PyCodeObject *code, CodeState *cs, PyObject **alt);

/* capture_code_mode(mode) -> previous mode (Python function of _C).  New reference
 * (an int), or NULL with an exception set. */
PyObject *capture_code_set_mode(PyObject *module, PyObject *mode);
/* mark_capture_code(code): code written for a capture; never replaced itself.  New
 * reference (None), or NULL with an exception set. */
PyObject *capture_code_mark(PyObject *module, PyObject *code);

#endif
