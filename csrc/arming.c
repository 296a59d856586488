/* arming.c - armed regions: their count (which installs and uninstalls the hook),
 * call regions, context regions with their tokens, and the per-thread cache the
 * hook reads (arming.h).
 *
 * Depends on the version layer only: the hook is handed over by arming_init, and
 * nothing here runs a frame.  Reentrancy: nothing here runs Python code but
 * arm_pop dropping the last reference to a config (arming.h).
 */
#include "arming.h"

/* ------------------------------------------------------------------ regions */

static Py_ssize_t armed_regions;        /* protected by the GIL */
static uint64_t arm_seq;                /* last seq given to a context region */
static NnsEvalFrameFunc the_hook;       /* eval_frame.c's evaluator, set by arming_init */
static NnsEvalFrameFunc previous_eval_frame;
static int hook_installed;
static PyObject *arm_var;               /* owned: the ContextVar of context regions */
static PyObject *thread_guard_key;      /* owned: key of the ThreadGuard in the thread dict */

_Thread_local ThreadArm arm_thread;
ArmHot arm_hot;

static void
install_hook(void)
{
    previous_eval_frame = nns_get_eval_frame();
    if (previous_eval_frame == the_hook) {
        previous_eval_frame = NULL;
    }
    nns_set_eval_frame(the_hook);
    hook_installed = 1;
}

static void
uninstall_hook(void)
{
    /* Restore only if nobody replaced us in between (they own the slot then). */
    if (nns_get_eval_frame() == the_hook) {
        nns_set_eval_frame(previous_eval_frame ? previous_eval_frame : nns_default_eval_frame());
    }
    previous_eval_frame = NULL;
    hook_installed = 0;
}

static void
region_open(void)
{
    if (armed_regions++ == 0) {
        install_hook();
    }
}

static void
region_close(void)
{
    if (--armed_regions == 0) {
        uninstall_hook();
    }
}

/* Counting (see RegionCount): one count per chain of nested regions that is
 * armed, so that a disable() inside it can take the count away and the hook is
 * uninstalled meanwhile.  A region opening inside one that holds the count takes
 * it over (armed: the count moves; disable(): the count is dropped) and hands it
 * back when it closes; if the outer one closes first, the inner keeps it. */
static void
count_open(RegionCount *rc, int armed, RegionCount *outer, PyObject *home)
{
    rc->counted = 0;
    rc->lent_to = rc->lent_from = NULL;
    rc->home = home;
    /* A disable() takes the count only from a region of its own context: a task
     * copied from an armed context must not uninstall the hook under the region
     * that armed it, which is still open there. */
    if (outer != NULL && !armed && outer->home != NULL && outer->home != home) {
        outer = NULL;
    }
    if (outer != NULL && outer->counted && outer->lent_to == NULL) {
        outer->counted = 0;
        outer->lent_to = rc;
        rc->lent_from = outer;
        if (armed) {
            rc->counted = 1;
        }
        else {
            region_close();
        }
    }
    else if (armed) {
        rc->counted = 1;
        region_open();
    }
}

static void
count_close(RegionCount *rc)
{
    RegionCount *lender = rc->lent_from;
    if (rc->lent_to != NULL) {
        /* Closed before the region holding our count: that one keeps it. */
        rc->lent_to->lent_from = NULL;
        rc->lent_to = NULL;
    }
    if (lender != NULL) {
        lender->lent_to = NULL;
        lender->counted = 1;
        if (!rc->counted) {
            region_open();   /* a disable() gives back the count it dropped */
        }
        rc->counted = 0;
        rc->lent_from = NULL;
    }
    else if (rc->counted) {
        rc->counted = 0;
        region_close();
    }
}

static inline int
is_armed_config(PyObject *config)
{
    return config != NULL && config != Py_None;
}

/* ------------------------------------------------ context regions' values */

/* ArmState is declared in arming.h (the inline lookup reads it); made and changed
 * only here. */
static int
arm_state_traverse(ArmState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->config);
    Py_VISIT(self->target);
    Py_VISIT(self->home);
    Py_VISIT(self->prev);
    return 0;
}

static int
arm_state_clear(ArmState *self)
{
    arm_hot_forget();   /* its config and target are about to go */
    Py_CLEAR(self->config);
    Py_CLEAR(self->target);
    Py_CLEAR(self->home);
    Py_CLEAR(self->prev);
    return 0;
}

static void
arm_state_dealloc(ArmState *self)
{
    PyObject_GC_UnTrack(self);
    arm_state_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ArmState_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.ArmState",
    .tp_basicsize = sizeof(ArmState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The arming of one context region (internal).",
    .tp_dealloc = (destructor)arm_state_dealloc,
    .tp_traverse = (traverseproc)arm_state_traverse,
    .tp_clear = (inquiry)arm_state_clear,
};

/* ------------------------------------ the per-thread cache and call regions */

int
arm_thread_refresh(PyThreadState *ts, ThreadArm *arm, ArmState **out)
{
    ArmState *state = NULL;
    if (nns_thread_context(ts) != NULL) {
        /* With a context present this is a HAMT lookup of an identity-hashed key:
         * no allocation, no Python. */
        PyObject *value = NULL;
        if (PyContextVar_Get(arm_var, NULL, &value) < 0) {
            return -1;
        }
        if (value != NULL && Py_IS_TYPE(value, &ArmState_Type)) {
            state = (ArmState *)value;
        }
        Py_XDECREF(value);   /* the context keeps it alive (see ThreadArm) */
        while (state != NULL && !state->active) {
            state = (ArmState *)state->prev;
        }
    }
    arm->ts_id = nns_thread_id(ts);
    arm->ctx_ver = nns_thread_context_version(ts);
    arm->state = state;
    *out = state;
    return 0;
}

/* arm_var was set on this thread: the context version does not move for a set, so the
 * cache is dropped by hand. */
static inline void
context_state_forget(void)
{
    arm_hot_forget();
    arm_thread.ts_id = 0;
    arm_thread.state = NULL;
}

int
arm_current(PyObject **config, PyObject **target)
{
    return arm_resolve(PyThreadState_Get(), config, target);
}

void
arm_push(ArmSaved *saved, PyObject *config, PyObject *target)
{
    arm_push_home(saved, config, target, NULL);
}

void
arm_push_home(ArmSaved *saved, PyObject *config, PyObject *target, PyObject *home)
{
    ThreadArm *arm = &arm_thread;
    int now = is_armed_config(config);
    saved->outer = arm->calls;
    saved->config = now ? Py_NewRef(config) : NULL;
    saved->target = (now && target != NULL) ? Py_NewRef(target) : NULL;
    saved->home = (now && home != NULL) ? Py_NewRef(home) : NULL;
    saved->seq = arm_seq;
    saved->resume_config = saved->resume_target = saved->resume_home = NULL;
    arm_hot_forget();
    if (now) {
        PyObject *outer_config, *outer_target;
        RegionCount *outer = NULL;
        if (arm_resolve_region(PyThreadState_Get(), &outer_config, &outer_target, &outer) < 0) {
            /* Cannot happen: arm_var is a ContextVar, and with a context present
             * its lookup allocates nothing.  Counted on its own then. */
            PyErr_Clear();
            outer = NULL;
        }
        count_open(&saved->count, 1, outer, NULL);
    }
    else {
        /* Nothing armed: our own code being decided.  It is short and takes no
         * count, so the hook stays installed across it. */
        count_open(&saved->count, 0, NULL, NULL);
    }
    arm->calls = saved;
}

void
arm_push_disarmed(ArmSaved *saved)
{
    ThreadArm *arm = &arm_thread;
    PyThreadState *ts = PyThreadState_Get();
    PyObject *config = NULL, *target = NULL;
    RegionCount *outer = NULL;
    if (arm_resolve_region(ts, &config, &target, &outer) < 0) {
        /* Cannot happen (see arm_push_home): nothing to take over or resume then. */
        PyErr_Clear();
        config = target = NULL;
        outer = NULL;
    }
    int resumable = is_armed_config(config);
    PyObject *home = resumable ? arm_current_home(ts) : NULL;
    saved->outer = arm->calls;
    saved->config = saved->target = saved->home = NULL;
    saved->resume_config = resumable ? Py_NewRef(config) : NULL;
    saved->resume_target = resumable ? Py_XNewRef(target) : NULL;
    saved->resume_home = resumable ? Py_XNewRef(home) : NULL;
    saved->seq = arm_seq;
    arm_hot_forget();
    /* As a disable() does: the count moves here and is dropped while we are open. */
    count_open(&saved->count, 0, outer, NULL);
    arm->calls = saved;
}

int
arm_push_resumed(ArmSaved *saved)
{
    PyObject *config, *target;
    RegionCount *count;
    if (arm_resolve_region(PyThreadState_Get(), &config, &target, &count) < 0) {
        PyErr_Clear();
        return 0;
    }
    ArmSaved *call = arm_thread.calls;
    if (call == NULL || count != &call->count || call->resume_config == NULL) {
        return 0;   /* a region opened inside the disarmed one decides, or none */
    }
    arm_push_home(saved, call->resume_config, call->resume_target, call->resume_home);
    return 1;
}

void
arm_pop(ArmSaved *saved)
{
    ThreadArm *arm = &arm_thread;
    PyObject *config = saved->config;
    PyObject *target = saved->target;
    PyObject *home = saved->home;
    /* LIFO by construction (C nesting); unlink by search all the same, so that a
     * mistake can only leave a region open, never a dangling pointer. */
    arm_hot_forget();   /* before the config can be freed below */
    ArmSaved **link = &arm->calls;
    while (*link != NULL && *link != saved) {
        link = &(*link)->outer;
    }
    if (*link == saved) {
        *link = saved->outer;
    }
    PyObject *resume_config = saved->resume_config;
    PyObject *resume_target = saved->resume_target;
    PyObject *resume_home = saved->resume_home;
    saved->config = NULL;
    saved->target = NULL;
    saved->home = NULL;
    saved->resume_config = saved->resume_target = saved->resume_home = NULL;
    count_close(&saved->count);
    Py_XDECREF(config);
    Py_XDECREF(target);
    Py_XDECREF(home);
    Py_XDECREF(resume_config);
    Py_XDECREF(resume_target);
    Py_XDECREF(resume_home);
}

PyObject *
arm_current_home(PyThreadState *ts)
{
    PyObject *config, *target;
    RegionCount *count;
    if (arm_resolve_region(ts, &config, &target, &count) < 0) {
        PyErr_Clear();
        return NULL;
    }
    ArmSaved *call = arm_thread.calls;
    if (call != NULL && count == &call->count) {
        return call->home;
    }
    ArmState *state = arm_thread.state;   /* what arm_resolve_region just refreshed */
    return (state != NULL && count == &state->count) ? state->home : NULL;
}

/* ------------------------------------------------------- tokens and threads */

enum { TOKEN_OPEN, TOKEN_DISARMED, TOKEN_DROPPED, TOKEN_THREAD_ENDED };

struct ThreadGuard;

typedef struct ArmToken {
    PyObject_HEAD
    ArmState *state;             /* owned: the value this token set */
    PyObject *context;           /* owned: the context it was set in */
    uint64_t thread_id;          /* ts->id of the arming thread */
    unsigned long thread_ident;  /* for messages */
    struct ThreadGuard *guard;   /* borrowed; NULL once closed */
    struct ArmToken *next, *prev_token;   /* the guard's list of open tokens */
    int status;
} ArmToken;

/* Lives in the thread-state dict of a thread that armed a context region; that
 * dict is cleared when the thread state is (at thread exit, or at finalization),
 * and closing the open tokens then gives back their region counts. */
typedef struct ThreadGuard {
    PyObject_HEAD
    ArmToken *open;              /* borrowed list: each token unlinks itself */
} ThreadGuard;

static void
token_close(ArmToken *token, int why)
{
    if (token->status != TOKEN_OPEN) {
        return;
    }
    token->status = why;
    if (token->guard != NULL) {
        if (token->prev_token != NULL) {
            token->prev_token->next = token->next;
        }
        else {
            token->guard->open = token->next;
        }
        if (token->next != NULL) {
            token->next->prev_token = token->prev_token;
        }
        token->guard = NULL;
        token->next = token->prev_token = NULL;
    }
    if (token->state != NULL) {
        arm_hot_forget();
        token->state->active = 0;
        count_close(&token->state->count);
    }
}

static void
thread_guard_dealloc(ThreadGuard *self)
{
    while (self->open != NULL) {
        token_close(self->open, TOKEN_THREAD_ENDED);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ThreadGuard_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.ThreadGuard",
    .tp_basicsize = sizeof(ThreadGuard),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Closes the regions a thread left open when the thread ends (internal).",
    .tp_dealloc = (destructor)thread_guard_dealloc,
};

/* Borrowed guard of the current thread (created on first use); NULL with an
 * exception set on failure. */
static ThreadGuard *
thread_guard_get(void)
{
    PyObject *dict = PyThreadState_GetDict();   /* borrowed */
    if (dict == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "nnscaler: this thread has no state dict");
        return NULL;
    }
    PyObject *guard = PyDict_GetItemWithError(dict, thread_guard_key);   /* borrowed */
    if (guard != NULL && Py_IS_TYPE(guard, &ThreadGuard_Type)) {
        return (ThreadGuard *)guard;
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    guard = (PyObject *)PyObject_New(ThreadGuard, &ThreadGuard_Type);
    if (guard == NULL) {
        return NULL;
    }
    ((ThreadGuard *)guard)->open = NULL;
    int rc = PyDict_SetItem(dict, thread_guard_key, guard);
    Py_DECREF(guard);   /* the dict owns it now (or it is gone on failure) */
    return rc < 0 ? NULL : (ThreadGuard *)guard;
}

static int
arm_token_traverse(ArmToken *self, visitproc visit, void *arg)
{
    Py_VISIT(self->state);
    Py_VISIT(self->context);
    return 0;
}

static int
arm_token_clear(ArmToken *self)
{
    /* Unreachable while open: nobody can disarm it any more; close its region. */
    token_close(self, TOKEN_DROPPED);
    Py_CLEAR(self->state);
    Py_CLEAR(self->context);
    return 0;
}

static void
arm_token_dealloc(ArmToken *self)
{
    PyObject_GC_UnTrack(self);
    arm_token_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyTypeObject ArmToken_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.ArmToken",
    .tp_basicsize = sizeof(ArmToken),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "What arm() opened; hand it back to disarm() on the same thread and in\n"
              "the same context, innermost first.  Dropping it closes its region.",
    .tp_dealloc = (destructor)arm_token_dealloc,
    .tp_traverse = (traverseproc)arm_token_traverse,
    .tp_clear = (inquiry)arm_token_clear,
};

PyObject *
arm_context(PyObject *config, PyObject *target, PyObject *home)
{
    PyObject *result = NULL;
    /* owned */
    PyObject *prev = NULL;
    ArmState *state = NULL;
    ArmToken *token = NULL;
    PyObject *var_token = NULL;
    /* borrowed */
    PyThreadState *ts = PyThreadState_Get();
    ThreadGuard *guard;
    int now = is_armed_config(config);

    if ((guard = thread_guard_get()) == NULL) {
        goto done;
    }
    if (PyContextVar_Get(arm_var, NULL, &prev) < 0) {
        goto done;
    }
    if (prev != NULL && !Py_IS_TYPE(prev, &ArmState_Type)) {
        Py_CLEAR(prev);   /* None: nothing was armed in this context */
    }
    /* Regions already closed (dropped tokens) are left out of the chain, so that
     * it does not grow with every token dropped. */
    while (prev != NULL && !((ArmState *)prev)->active) {
        Py_XSETREF(prev, Py_XNewRef(((ArmState *)prev)->prev));
    }
    state = PyObject_GC_New(ArmState, &ArmState_Type);
    if (state == NULL) {
        goto done;
    }
    state->config = now ? Py_NewRef(config) : NULL;
    state->target = (now && target != NULL) ? Py_NewRef(target) : NULL;
    state->home = (now && home != NULL) ? Py_NewRef(home) : NULL;
    state->prev = prev;   /* moved */
    prev = NULL;
    state->seq = ++arm_seq;
    state->active = 0;   /* open once committed below */
    state->count.counted = 0;
    state->count.lent_to = state->count.lent_from = NULL;
    state->count.home = NULL;
    PyObject_GC_Track(state);

    token = PyObject_GC_New(ArmToken, &ArmToken_Type);
    if (token == NULL) {
        goto done;
    }
    token->state = (ArmState *)Py_NewRef(state);
    token->context = NULL;   /* known once set: the set creates it if missing */
    token->thread_id = nns_thread_id(ts);
    token->thread_ident = PyThread_get_thread_ident();
    token->guard = NULL;
    token->next = token->prev_token = NULL;
    token->status = TOKEN_DISARMED;   /* not open until committed below */
    PyObject_GC_Track(token);

    /* The region this one opens inside (for disable(): the count it borrows). */
    PyObject *outer_config, *outer_target;
    RegionCount *outer_count;
    if (arm_resolve_region(ts, &outer_config, &outer_target, &outer_count) < 0) {
        goto done;
    }
    var_token = PyContextVar_Set(arm_var, (PyObject *)state);
    if (var_token == NULL) {
        goto done;
    }
    /* Committed: nothing below fails or runs Python. */
    token->context = Py_XNewRef(nns_thread_context(ts));
    context_state_forget();
    state->active = 1;
    count_open(&state->count, now, outer_count, nns_thread_context(ts));
    token->status = TOKEN_OPEN;
    token->guard = guard;
    token->next = guard->open;
    if (guard->open != NULL) {
        guard->open->prev_token = token;
    }
    guard->open = token;
    result = (PyObject *)token;
    token = NULL;
done:
    Py_XDECREF(var_token);
    Py_XDECREF(prev);
    Py_XDECREF(state);
    Py_XDECREF(token);
    return result;
}

int
disarm_context(PyObject *obj)
{
    int rc = -1;
    PyObject *value = NULL;       /* owned */
    PyObject *var_token = NULL;   /* owned */
    PyThreadState *ts = PyThreadState_Get();
    ArmToken *token = (ArmToken *)obj;

    if (!Py_IS_TYPE(obj, &ArmToken_Type)) {
        PyErr_Format(PyExc_TypeError, "disarm(): expected an ArmToken, not %.100s",
                     Py_TYPE(obj)->tp_name);
        goto done;
    }
    if (token->status == TOKEN_THREAD_ENDED) {
        PyErr_SetString(PyExc_RuntimeError,
                        "disarm(): the thread that armed this token has ended; its region "
                        "was closed then");
        goto done;
    }
    if (token->status != TOKEN_OPEN) {
        PyErr_SetString(PyExc_RuntimeError, "disarm(): this token was already used");
        goto done;
    }
    if (token->thread_id != nns_thread_id(ts)) {
        PyErr_Format(PyExc_RuntimeError,
                     "disarm(): this token was armed on thread %lu and cannot be disarmed "
                     "on thread %lu: arming is per thread",
                     token->thread_ident, PyThread_get_thread_ident());
        goto done;
    }
    if (token->context != nns_thread_context(ts)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "disarm(): this token was armed in another context (another asyncio "
                        "task, or inside contextvars.Context.run()); disarm it in the "
                        "context that armed it");
        goto done;
    }
    if (PyContextVar_Get(arm_var, NULL, &value) < 0) {
        goto done;
    }
    /* Regions armed after this one in this context must be closed first; those
     * whose token was dropped are closed already and are skipped. */
    PyObject *cur = value;
    while (cur != (PyObject *)token->state) {
        if (cur == NULL || !Py_IS_TYPE(cur, &ArmState_Type)) {
            PyErr_SetString(PyExc_RuntimeError,
                            "disarm(): this token's region is no longer the current one in "
                            "this context (was the context variable reset?)");
            goto done;
        }
        if (((ArmState *)cur)->active) {
            PyErr_SetString(PyExc_RuntimeError,
                            "disarm(): out of order: an enable()/disable() entered after "
                            "this one in the same context is still open; exit it first");
            goto done;
        }
        cur = ((ArmState *)cur)->prev;
    }
    PyObject *restore = token->state->prev;
    while (restore != NULL && !((ArmState *)restore)->active) {
        restore = ((ArmState *)restore)->prev;
    }
    if (restore == NULL) {
        restore = Py_None;
    }
    if ((var_token = PyContextVar_Set(arm_var, restore)) == NULL) {
        goto done;
    }
    context_state_forget();
    token_close(token, TOKEN_DISARMED);
    rc = 0;
done:
    Py_XDECREF(value);
    Py_XDECREF(var_token);
    return rc;
}

int
arming_init(PyObject *module, NnsEvalFrameFunc hook)
{
    the_hook = hook;
    if (PyType_Ready(&ArmState_Type) < 0 || PyType_Ready(&ThreadGuard_Type) < 0 ||
        PyType_Ready(&ArmToken_Type) < 0) {
        return -1;
    }
    if (PyModule_AddObjectRef(module, "ArmToken", (PyObject *)&ArmToken_Type) < 0) {
        return -1;
    }
    if (arm_var == NULL && (arm_var = PyContextVar_New("nnscaler_eval.armed", NULL)) == NULL) {
        return -1;
    }
    if (thread_guard_key == NULL &&
        (thread_guard_key = PyUnicode_InternFromString("nnscaler_eval.thread_guard")) == NULL) {
        return -1;
    }
    return 0;
}

int
arm_hook_installed(void)
{
    return hook_installed &&
           nns_get_eval_frame() == the_hook;
}

Py_ssize_t
arm_open_regions(void)
{
    return armed_regions;
}
