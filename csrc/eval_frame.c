/* eval_frame.c - the PEP 523 frame evaluator.
 *
 * Hot path order (cheapest test first): thread not armed -> default evaluator;
 * code decided as skipped -> default; rewrite mode -> run the rewritten code;
 * capture mode -> guards, cache, dispatch (dispatch.c).  Which region a frame runs
 * under is arming.c's (looked up inline, arming.h); running the frame's code other
 * ways is frame_calls.c's.  This file is the hook's entry only, and nothing but
 * module.c (which initialises it) depends on it.
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
#include "arming.h"
#include "frame_calls.h"
#include "code_state.h"
#include "frame_record.h"
#include "dispatch.h"
#include "capture_code.h"
#include "nns_globals.h"

static PyObject *nns_eval_frame(PyThreadState *ts, NnsFrame *frame, int throw_flag);

int
eval_frame_init(PyObject *module)
{
    return arming_init(module, nns_eval_frame);
}

/* The armed path, for frames the fast path in nns_eval_frame did not pass through:
 * `config` and `target` are this frame's region (borrowed, valid until Python runs);
 * never entered with throw_flag. */
static PyObject *
eval_frame_armed(PyThreadState *ts, NnsFrame *frame, PyObject *config, PyObject *target)
{
    const int throw_flag = 0;
    PyCodeObject *code = nns_frame_code(frame);
    CodeState *cs = code_state_peek(code);
    if (cs == NULL) {
        /* First sight of this code object: decide once (may rewrite, may warn).
         * Our own Python must not be intercepted meanwhile: a call region with
         * nothing armed.  It may have run Python, so the region is read again. */
        ArmSaved quiet;
        arm_push(&quiet, NULL, NULL);
        cs = code_state_get(code);
        arm_pop(&quiet);
        if (cs == NULL) {
            goto internal_error;
        }
        if (!(cs->flags & (CS_FORWARD | CS_SKIP)) && code->co_argcount >= 1) {
            /* A forward under another name (`forward = fwd` in the class body, an
             * instance's bound `forward`): what nn.Module calls decides, not the
             * name.  Seen on the code's first frame, the one nn.Module made. */
            PyObject **args = nns_frame_localsplus(frame);
            if (args == NULL) {
                goto internal_error;
            }
            PyObject *self = args[0];
            if (self != NULL && PyObject_TypeCheck(self, nns_globals.module_type)) {
                code_state_learn_forward(cs, code, self);
            }
        }
        if (arm_resolve(ts, &config, &target) < 0) {
            goto internal_error;
        }
        if (config == NULL) {
            return frame_run_default(ts, frame, throw_flag);
        }
    }
    if (capture_code_active() && config == nns_globals.rewrite_mode &&
        !(cs->flags & CS_CAPTURE_CODE) && !nns_frame_is_generator(frame) &&
        !nns_thread_in_trace_callback(ts)) {
        /* A capture records: the user's code with its `if`s hooked (capture_code.h). */
        PyObject *alt = NULL;   /* borrowed from cs */
        ArmSaved quiet;   /* the decision is our own Python: not intercepted */
        arm_push(&quiet, NULL, NULL);
        int decided = capture_code_for(frame, code, cs, &alt);
        arm_pop(&quiet);
        if (decided < 0) {
            return NULL;
        }
        if (alt != NULL) {
            return frame_run_code(ts, frame, alt, throw_flag);
        }
    }
    if ((cs->flags & CS_SKIP) || nns_frame_is_generator(frame) ||
        nns_thread_in_trace_callback(ts)) {
        return frame_run_default(ts, frame, throw_flag);
    }
    if (config != nns_globals.rewrite_mode) {
        PyObject **slots = nns_frame_localsplus(frame);
        if (slots == NULL) {
            goto internal_error;
        }
        /* A module forward is keyed per `self` even when it is also the compiled
         * target (compile(model.forward)): a module in the key would pin it. */
        if ((cs->flags & CS_FORWARD) &&
            PyObject_TypeCheck(slots[0], nns_globals.module_type)) {
            return dispatch_capture(ts, frame, code, cs, slots[0], config);
        }
        if (target == (PyObject *)code) {
            return dispatch_capture(ts, frame, code, cs, NULL, config);
        }
    }
    if (cs->rewritten != NULL) {
        return frame_run_rewritten(ts, frame, cs, throw_flag);
    }
    return frame_run_default(ts, frame, throw_flag);

internal_error:
    if (nns_report_internal_error("deciding a code object") < 0) {
        return NULL;
    }
    return frame_run_default(ts, frame, throw_flag);
}

/* Every frame the fast path below did not pass on.  Out of line, so that the fast
 * path saves few registers and has no stack frame of its own. */
static __attribute__((noinline)) PyObject *
eval_frame_slow(PyThreadState *ts, NnsFrame *frame, int throw_flag)
{
    PyObject *config = NULL, *target = NULL;   /* borrowed from the region, valid
                                                * until Python runs */
    if (frame_record_active()) {
        frame_record_note(frame);   /* a capture is running on this thread */
    }
    if (throw_flag) {   /* a generator resumed by throw(): never replaced */
        return nns_eval_frame_passthrough(ts, frame, throw_flag);
    }
    int resolved = arm_resolve(ts, &config, &target);
    if (resolved == 0) {
        if (config == NULL) {
            return nns_eval_frame_passthrough(ts, frame, throw_flag);
        }
        arm_hot_fill(ts, config, target);   /* the next frame takes the fast path */
        PyCodeObject *code = nns_frame_code(frame);
        assert(code == nns_frame_code_inline(frame));
        CodeState *cs = code_state_peek(code);
        if (cs != NULL && code_state_passes(cs, (PyObject *)code, target) &&
            !capture_code_wanted(cs)) {
            return nns_eval_frame_passthrough(ts, frame, throw_flag);
        }
    }
    /* A frame we return for without running it is ours to clear and pop on 3.12+
     * (compat.h, nns_frame_run_enter). */
    NnsFrameRun run;
    nns_frame_run_enter(&run, frame);
    PyObject *result;
    if (resolved < 0) {
        result = nns_report_internal_error("reading this context's arming") < 0
            ? NULL : frame_run_default(ts, frame, throw_flag);
    }
    else {
        result = eval_frame_armed(ts, frame, config, target);
    }
    return nns_frame_run_leave(ts, &run, result);
}

/* The hook.  The fast path is for every frame an armed region runs that is not ours
 * to replace (torch's Python wrappers under a compiled call, say): with no capture
 * recording and this thread's region in the hot slot (arming.h), three comparisons
 * against the thread state, the code's state, and the frame goes to CPython's
 * evaluator: no thread-local read, no call, no bracket. */
static PyObject *
nns_eval_frame(PyThreadState *ts, NnsFrame *frame, int throw_flag)
{
    PyObject *config, *target;   /* borrowed: the hot slot's */
    if (frame_record_threads == 0 && capture_code_threads == 0 && !throw_flag &&
        arm_resolve_hot(ts, &config, &target)) {
        PyCodeObject *code = nns_frame_code_inline(frame);
        CodeState *cs = code_state_peek_direct(code);
        if (cs != NULL && code_state_passes(cs, (PyObject *)code, target)) {
            return nns_eval_frame_passthrough(ts, frame, throw_flag);
        }
    }
    return eval_frame_slow(ts, frame, throw_flag);
}
