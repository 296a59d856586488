/* nns_globals.h - process-wide objects the C core needs on its hot paths.
 *
 * Filled once by _C.install() when nnscaler_eval is imported (see
 * nnscaler_eval/_install.py).  One interpreter only: the PEP 523 hook has no module
 * object to reach state through, so these live in one static struct.  All fields
 * are strong references owned by this struct and stay alive for the process.
 */
#ifndef NNSCALER_GLOBALS_H
#define NNSCALER_GLOBALS_H

#include "compat.h"
#include "guard_env.h"   /* the objects guards/ needs, set with these */

typedef struct {
    Py_ssize_t code_extra_index;   /* from _PyEval_RequestCodeExtraIndex, -1 before init */
    PyObject *ifexpr;              /* nnscaler.runtime.function.ifexpr */
    PyObject *convert_frame;       /* nnscaler_eval.convert_frame.convert_frame */
    PyObject *capture_code;        /* nnscaler_eval.capture.branches.capture_code, or NULL */
    PyObject *rewrite_mode;        /* the config object that means "rewrite only" */
    PyObject *run_eagerly;         /* sentinel convert_frame returns: evaluate the frame */
    PyObject *run_disarmed;        /* ... evaluate it with callees not intercepted either */
    PyObject *internal_prefix;     /* str: directory of nnscaler_eval (frames hidden in tracebacks) */
    PyTypeObject *module_type;     /* torch.nn.Module */
    PyObject *global_hook_dicts;   /* tuple of torch.nn.modules.module._global_*_hooks dicts */
    PyObject *len_torch_function_stack;   /* torch._C._len_torch_function_stack */
    PyObject *pop_torch_function_stack;   /* torch._C._pop_torch_function_stack */
    /* interned names */
    PyObject *str_forward, *str_call_impl, *str_wrapped;
    PyObject *str_forward_hooks, *str_forward_pre_hooks, *str_backward_hooks,
        *str_backward_pre_hooks;
} NnsGlobals;

extern NnsGlobals nns_globals;

/* Report an error of our own without losing the user's call: a pending Exception
 * becomes a RuntimeWarning naming `where` and 0 is returned.  Anything else
 * (KeyboardInterrupt, SystemExit, MemoryError, other BaseExceptions) is left set
 * and -1 returned: it must propagate.  -1 also if the warning itself raised
 * (warnings turned into errors), with that exception set.  May run Python (the
 * warnings machinery). */
int nns_report_internal_error(const char *where);

#endif
