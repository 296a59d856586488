/* eval_frame.c - the PEP 523 frame evaluator.
 *
 * Hot path order (cheapest test first): thread not armed -> default evaluator;
 * code decided as skipped -> default; rewrite mode -> run the rewritten code;
 * capture mode -> guards, cache, dispatch (dispatch.c).
 *
 * How a frame is "replaced" on 3.11: _PyEval_Vector pushes and fills the frame,
 * calls the evaluator, then clears and pops the frame whatever the evaluator did.
 * So returning a result without evaluating the frame is enough: its arguments are
 * released by the caller.  Nothing here keeps a pointer to the frame after return.
 *
 * Reentrancy: every call out of this file (rewritten function, convert_frame,
 * runner) may run arbitrary Python, including code that arms or disarms this
 * thread or other threads; nothing cached across those calls is trusted after.
 */
#include "eval_frame.h"
#include "code_state.h"
#include "dispatch.h"
#include "nns_globals.h"

typedef struct {
    PyObject *config;        /* owned; NULL = not armed */
    PyObject *target;        /* owned; NULL or a code object */
} ThreadArm;

static _Thread_local ThreadArm tls_arm;
static Py_ssize_t armed_threads;        /* protected by the GIL */
static _PyFrameEvalFunction previous_eval_frame;
static int hook_installed;

static PyObject *nns_eval_frame(PyThreadState *ts, NnsFrame *frame, int throw_flag);

static void
install_hook(void)
{
    PyInterpreterState *interp = PyInterpreterState_Get();
    previous_eval_frame = _PyInterpreterState_GetEvalFrameFunc(interp);
    if (previous_eval_frame == nns_eval_frame) {
        previous_eval_frame = NULL;
    }
    _PyInterpreterState_SetEvalFrameFunc(interp, nns_eval_frame);
    hook_installed = 1;
}

static void
uninstall_hook(void)
{
    PyInterpreterState *interp = PyInterpreterState_Get();
    /* Restore only if nobody replaced us in between (they own the slot then). */
    if (_PyInterpreterState_GetEvalFrameFunc(interp) == nns_eval_frame) {
        _PyInterpreterState_SetEvalFrameFunc(
            interp, previous_eval_frame ? previous_eval_frame : _PyEval_EvalFrameDefault);
    }
    previous_eval_frame = NULL;
    hook_installed = 0;
}

static inline int
is_armed_config(PyObject *config)
{
    return config != NULL && config != Py_None;
}

void
arm_push(ArmSaved *saved, PyObject *config, PyObject *target)
{
    ThreadArm *arm = &tls_arm;
    saved->config = arm->config;     /* ownership moves into `saved` */
    saved->target = arm->target;
    int was = is_armed_config(arm->config);
    int now = is_armed_config(config);
    arm->config = now ? Py_NewRef(config) : NULL;
    arm->target = (now && target != NULL) ? Py_NewRef(target) : NULL;
    if (!was && now && armed_threads++ == 0) {
        install_hook();
    }
    else if (was && !now && --armed_threads == 0) {
        uninstall_hook();
    }
}

void
arm_pop(ArmSaved *saved)
{
    ThreadArm *arm = &tls_arm;
    int was = is_armed_config(arm->config);
    int now = is_armed_config(saved->config);
    Py_XDECREF(arm->config);
    Py_XDECREF(arm->target);
    arm->config = saved->config;
    arm->target = saved->target;
    saved->config = NULL;
    saved->target = NULL;
    if (!was && now && armed_threads++ == 0) {
        install_hook();
    }
    else if (was && !now && --armed_threads == 0) {
        uninstall_hook();
    }
}

PyObject *
arm_current_config(void)
{
    return tls_arm.config;
}

int
eval_frame_installed(void)
{
    return hook_installed &&
           _PyInterpreterState_GetEvalFrameFunc(PyInterpreterState_Get()) == nns_eval_frame;
}

Py_ssize_t
eval_frame_armed_threads(void)
{
    return armed_threads;
}

/* Frames we do not replace run on CPython's own evaluator, never on the evaluator
 * that was installed before us: that one may be Dynamo's shim, which hands frames
 * back to whatever the interpreter's eval_frame is (us), and after Dynamo swapped
 * evaluators underneath an armed region the two called each other forever.
 * Dynamo installs its shim itself whenever it runs compiled code, so it needs
 * nothing from a chain; the previous evaluator is only restored on disarm. */
static inline PyObject *
run_default(PyThreadState *ts, NnsFrame *frame, int throw_flag)
{
    return nns_eval_frame_default(ts, frame, throw_flag);
}

Py_ssize_t
code_arg_slots(PyCodeObject *code)
{
    Py_ssize_t n = code->co_argcount + code->co_kwonlyargcount;
    if (code->co_flags & CO_VARARGS) {
        n++;
    }
    if (code->co_flags & CO_VARKEYWORDS) {
        n++;
    }
    return n;
}

PyObject *
call_with_slots(PyObject *callable, PyCodeObject *code, PyObject *const *slots)
{
    PyObject *result = NULL;
    PyObject *kwnames = NULL;            /* owned */
    PyObject *small[16];
    PyObject **args = small;
    Py_ssize_t npos = code->co_argcount;
    Py_ssize_t nkwonly = code->co_kwonlyargcount;
    Py_ssize_t index = npos + nkwonly;
    PyObject *varargs = (code->co_flags & CO_VARARGS) ? slots[index++] : NULL;
    PyObject *varkw = (code->co_flags & CO_VARKEYWORDS) ? slots[index] : NULL;
    Py_ssize_t nvar = varargs ? PyTuple_GET_SIZE(varargs) : 0;
    Py_ssize_t nvarkw = varkw ? PyDict_GET_SIZE(varkw) : 0;
    Py_ssize_t total = npos + nvar + nkwonly + nvarkw;

    if (total > (Py_ssize_t)(sizeof(small) / sizeof(small[0]))) {
        args = PyMem_Malloc(sizeof(PyObject *) * (size_t)total);
        if (args == NULL) {
            PyErr_NoMemory();
            goto error;
        }
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < npos; i++) {
        args[n++] = slots[i];
    }
    for (Py_ssize_t i = 0; i < nvar; i++) {
        args[n++] = PyTuple_GET_ITEM(varargs, i);
    }
    Py_ssize_t npositional = n;
    if (nkwonly + nvarkw > 0) {
        kwnames = PyTuple_New(nkwonly + nvarkw);
        if (kwnames == NULL) {
            goto error;
        }
        /* co_localsplusnames starts with the parameters in order. */
        PyObject *names = code->co_localsplusnames;
        for (Py_ssize_t i = 0; i < nkwonly; i++) {
            PyTuple_SET_ITEM(kwnames, i, Py_NewRef(PyTuple_GET_ITEM(names, npos + i)));
            args[n++] = slots[npos + i];
        }
        Py_ssize_t pos = 0, k = nkwonly;
        PyObject *key, *value;
        while (varkw != NULL && PyDict_Next(varkw, &pos, &key, &value)) {
            PyTuple_SET_ITEM(kwnames, k++, Py_NewRef(key));
            args[n++] = value;
        }
    }
    result = PyObject_Vectorcall(callable, args, (size_t)npositional, kwnames);
error:
    Py_XDECREF(kwnames);
    if (args != small) {
        PyMem_Free(args);
    }
    return result;
}

PyObject *
function_with_code(PyObject *func, PyObject *code)
{
    PyObject *closure = PyFunction_GET_CLOSURE(func);
    PyObject *fn = PyFunction_New(code, PyFunction_GET_GLOBALS(func));
    if (fn == NULL) {
        return NULL;
    }
    if (closure != NULL && PyFunction_SetClosure(fn, closure) < 0) {
        Py_DECREF(fn);
        return NULL;
    }
    return fn;
}

/* Runs the rewritten code in place of the frame's own code.  The new function is
 * made per call on purpose: caching it in the CodeState would hold the function's
 * globals, which usually lead back to this code object: a cycle the GC cannot see. */
static PyObject *
run_rewritten(PyThreadState *ts, NnsFrame *frame, CodeState *cs, int throw_flag)
{
    PyObject *func = nns_frame_function(frame);
    if (func == NULL || !PyFunction_Check(func)) {
        return run_default(ts, frame, throw_flag);
    }
    PyObject *fn = function_with_code(func, cs->rewritten);
    if (fn == NULL) {
        if (nns_report_internal_error("running rewritten code") < 0) {
            return NULL;
        }
        return run_default(ts, frame, throw_flag);
    }
    PyObject *result = call_with_slots(fn, nns_frame_code(frame), nns_frame_localsplus(frame));
    Py_DECREF(fn);
    return result;
}

static PyObject *
eval_frame_armed(PyThreadState *ts, NnsFrame *frame, int throw_flag)
{
    ThreadArm *arm = &tls_arm;
    if (arm->config == NULL || throw_flag) {
        return run_default(ts, frame, throw_flag);
    }
    PyCodeObject *code = nns_frame_code(frame);
    CodeState *cs = code_state_peek(code);
    if (cs == NULL) {
        /* First sight of this code object: decide once (may rewrite). Our own
         * Python must not be intercepted meanwhile, hence the config swap. */
        PyObject *config = arm->config;
        arm->config = NULL;
        cs = code_state_get(code);
        arm->config = config;
        if (cs == NULL) {
            if (nns_report_internal_error("deciding a code object") < 0) {
                return NULL;
            }
            return run_default(ts, frame, throw_flag);
        }
    }
    if ((cs->flags & CS_SKIP) || nns_frame_is_generator(frame) ||
        nns_thread_in_trace_callback(ts)) {
        return run_default(ts, frame, throw_flag);
    }
    if (arm->config != nns_globals.rewrite_mode) {
        PyObject **slots = nns_frame_localsplus(frame);
        PyObject *self = NULL;
        int target = 0;
        /* A module forward is keyed per `self` even when it is also the compiled
         * target (compile(model.forward)): a module in the key would pin it. */
        if ((cs->flags & CS_FORWARD) &&
            PyObject_TypeCheck(slots[0], nns_globals.module_type)) {
            target = 1;
            self = slots[0];
        }
        else if (arm->target == (PyObject *)code) {
            target = 1;
        }
        if (target) {
            return dispatch_capture(ts, frame, code, cs, self, arm->config);
        }
    }
    if (cs->rewritten != NULL) {
        return run_rewritten(ts, frame, cs, throw_flag);
    }
    return run_default(ts, frame, throw_flag);
}

static PyObject *
nns_eval_frame(PyThreadState *ts, NnsFrame *frame, int throw_flag)
{
    if (tls_arm.config == NULL || throw_flag) {
        return run_default(ts, frame, throw_flag);
    }
    /* A frame we return for without running it is ours to clear and pop on 3.12+
     * (compat.h, nns_frame_run_enter). */
    NnsFrameRun run;
    nns_frame_run_enter(&run, frame);
    return nns_frame_run_leave(ts, &run, eval_frame_armed(ts, frame, throw_flag));
}

/* Used by dispatch.c: run the frame eagerly (its rewritten code if any), the hook
 * still armed so that the forwards it calls are intercepted. */
PyObject *
eval_frame_run_eagerly(PyThreadState *ts, NnsFrame *frame, CodeState *cs)
{
    if (cs->rewritten != NULL) {
        return run_rewritten(ts, frame, cs, 0);
    }
    return run_default(ts, frame, 0);
}

/* Used by dispatch.c around Python callbacks and eager runs: nothing is captured
 * meanwhile, but frames still run their rewritten code (rewrite mode), so that a
 * submodule forward inlined by the tracer records `ifexpr` nodes rather than a
 * Python branch on its training flag.  Returns the config for eval_frame_resume. */
PyObject *
eval_frame_suspend(void)
{
    PyObject *config = tls_arm.config;
    tls_arm.config = nns_globals.rewrite_mode;
    return config;
}

void
eval_frame_resume(PyObject *config)
{
    tls_arm.config = config;
}
