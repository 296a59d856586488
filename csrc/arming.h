/* arming.h - armed regions: which config a thread's frames run under.
 *
 * The hook is installed only while at least one armed region is open (a count of
 * regions); whatever evaluator was installed before is restored when the count
 * drops to zero, so Python code outside armed regions runs on CPython's own
 * evaluator with all its specialisations.  This file owns that count and the
 * install/uninstall; the hook itself (eval_frame.c) is handed over at init, so that
 * arming depends on nothing but the version layer.
 *
 * A region arms with a *config*: the rewrite-mode sentinel (run rewritten code), a
 * capture config (a Python object handed to convert_frame on a miss), or nothing
 * (disable()).  Two kinds of region exist:
 *
 *  - Context regions (enable()/disable(), _C.arm()): the state lives in a
 *    contextvars.ContextVar, so it follows the context: two asyncio tasks that
 *    enter enable() around awaits each see their own state.  A token is tied to
 *    the thread and the context that armed it and must be disarmed in LIFO order;
 *    any other use raises RuntimeError naming what was wrong.  A token dropped
 *    without disarm(), or whose thread ends, closes its region.
 *  - Call regions (arm_push/arm_pop, C only): strictly nested on the C stack of
 *    one thread (a compiled call, a callback run with capture suspended).  No
 *    Python object is made, so they are cheap enough for every compiled call.
 *
 * The innermost region wins: a call region is overridden by a context region
 * armed after it was pushed (a `with enable():` inside a compiled forward), and
 * the other way round.  Frames find their region through a per-thread cache keyed
 * by the thread's context version, so the per-frame cost stays a few loads: that
 * lookup (arm_resolve_region) is inline in this header, for the hook's every frame.
 */
#ifndef NNSCALER_ARMING_H
#define NNSCALER_ARMING_H

#include "compat.h"

/* What one region contributes to the count of armed regions.  An armed region
 * holds one count.  A disable() region opened inside an armed one borrows that
 * count (the hook is uninstalled while only disabled regions remain), and gives
 * it back when it closes; whichever of the two closes first settles it. */
typedef struct RegionCount {
    int counted;                       /* holds one count */
    struct RegionCount *lent_to;       /* the region holding our count */
    struct RegionCount *lent_from;     /* the region whose count we hold */
    PyObject *home;                    /* borrowed: a context region's context (its
                                        * token holds it while open); NULL for call
                                        * regions */
} RegionCount;

/* One call region: lives on the C stack of the function that pushed it. */
typedef struct ArmSaved {
    struct ArmSaved *outer;  /* the call region below this one, or NULL */
    PyObject *config;        /* owned; NULL: nothing armed (own code, decide) */
    PyObject *target;        /* owned or NULL: code captured even if not a forward */
    PyObject *home;          /* owned or NULL: the list that owns the cache buckets made
                              * in this region (a compiled wrapper's; cache_table.h) */
    uint64_t seq;            /* context regions armed later than this have a larger seq */
    RegionCount count;
    /* arm_push_disarmed over an armed region only (NULL otherwise), all owned: that
     * region, armed as it was, for arm_push_resumed. */
    PyObject *resume_config;
    PyObject *resume_target;
    PyObject *resume_home;
} ArmSaved;

/* Module init: create the ContextVar and ready the types; `hook` (the PEP 523
 * evaluator, eval_frame.c's) is what opening the first region installs.  0, or -1
 * with an exception set.  Runs no Python code. */
int arming_init(PyObject *module, NnsEvalFrameFunc hook);

/* Push a call region armed with `config` (borrowed; NULL or None means nothing
 * armed) and an optional target code (borrowed, may be NULL).  Never fails, runs
 * no Python.  Every arm_push is matched by arm_pop with the same ArmSaved, on the
 * same thread, in LIFO order (C nesting). */
void arm_push(ArmSaved *saved, PyObject *config, PyObject *target);
/* arm_push, and the buckets made in the region are owned by `home` (borrowed, a
 * list; may be NULL), so that the GC sees them (cache_table.h). */
void arm_push_home(ArmSaved *saved, PyObject *config, PyObject *target, PyObject *home);
/* Pop what arm_push pushed. Never fails; may uninstall the hook.  Runs Python only
 * if it drops the last reference to the config (a finaliser or weakref callback:
 * the compiled wrapper was deleted during its own call). */
void arm_pop(ArmSaved *saved);

/* Push a call region in which this thread's frames run with nothing armed and
 * which, unlike arm_push(NULL), takes the count of the region it opens in: the hook
 * is uninstalled meanwhile unless another region still needs it (another thread's),
 * so plain Python run here pays no evaluator at all.  The region it opened in is
 * remembered for arm_push_resumed.  Never fails, runs no Python.  Popped with
 * arm_pop. */
void arm_push_disarmed(ArmSaved *saved);
/* If this thread's innermost region is one arm_push_disarmed pushed over an armed
 * region: push a call region armed as that one was (config, target, home) and
 * return 1 (pop it with arm_pop); else push nothing and return 0.  Never fails,
 * runs no Python. */
int arm_push_resumed(ArmSaved *saved);

/* Arm the current context with `config` (borrowed), `target` (borrowed, a code
 * object or NULL) and `home` (borrowed list or NULL: owns the cache buckets made in
 * the region).  New reference to an ArmToken, or NULL with an exception set.  Runs
 * no Python code. */
PyObject *arm_context(PyObject *config, PyObject *target, PyObject *home);
/* Close the region of `token` (borrowed).  0, or -1 with RuntimeError/TypeError
 * saying what was wrong (another thread, another context, out of order, used
 * twice).  Runs no Python code. */
int disarm_context(PyObject *token);

/* Borrowed: this thread's current config (NULL when nothing is armed), and its
 * target code (may be NULL).  -1 with an exception set only if the context lookup
 * failed, which cannot happen once a context exists.  Runs no Python code. */
int arm_current(PyObject **config, PyObject **target);

/* Borrowed home list of this thread's innermost region when it is a call region
 * pushed with one, else NULL.  Runs no Python, never raises. */
PyObject *arm_current_home(PyThreadState *ts);

/* 1 while the hook is installed in this interpreter.  Runs no Python. */
int arm_hook_installed(void);
/* Number of armed regions open right now (context regions whose token is live,
 * plus call regions on any thread's stack).  0 means the hook is uninstalled. */
Py_ssize_t arm_open_regions(void);

extern PyTypeObject ArmToken_Type;

/* ------------------------------------------- the per-frame lookup, inline
 *
 * What follows is arming.c's own state, in this header only so that the hook's
 * lookup of a frame's region (arm_resolve_region) inlines into the hook: a call
 * into another file per frame would cost instructions on every Python call made
 * in an armed region.  Only arming.c writes any of it. */

/* The value of the context-region ContextVar in a context: what one
 * enable()/disable()/arm() set.  Immutable but for `active`, which disarm (or the
 * token's end) clears; copies of the context (tasks created inside the region) then
 * see it as closed too. */
typedef struct ArmState {
    PyObject_HEAD
    PyObject *config;        /* owned or NULL (disable()) */
    PyObject *target;        /* owned or NULL */
    PyObject *home;          /* owned list or NULL: owns the cache buckets made in the
                                region (the config's; cache_table.h) */
    PyObject *prev;          /* owned ArmState or NULL: the value this one replaced */
    uint64_t seq;            /* order of creation, against call regions */
    int active;
    RegionCount count;
} ArmState;

/* Per-thread cache of the context region, valid while the thread state and its
 * context version are the ones recorded: CPython bumps the context version whenever
 * this thread enters or leaves a context (Context.run, asyncio task steps), and
 * the ContextVar is set only by arm_context/disarm_context on the thread whose
 * context it is, which drop the cache by hand (a set does not bump the version).
 * `state` is borrowed: the current context owns it (through the chain of `prev`)
 * for as long as the cache holds; its `active` flag is read on every use, since a
 * token closed on its own thread closes the region in copied contexts too. */
typedef struct {
    uint64_t ts_id;
    uint64_t ctx_ver;
    ArmState *state;         /* borrowed: innermost open context region, or NULL */
    ArmSaved *calls;         /* innermost call region on this thread's C stack */
} ThreadArm;

/* This thread's cache (defined in arming.c). */
extern _Thread_local ThreadArm arm_thread;

/* Slow path of arm_resolve_region: read this thread's context region from the
 * ContextVar into `arm` and `*out` (borrowed).  0, or -1 with an exception set
 * (the lookup failed).  Runs no Python code. */
int arm_thread_refresh(PyThreadState *ts, ThreadArm *arm, ArmState **out);

/* The innermost of `arm`'s regions, given its context region `state` (borrowed,
 * may be NULL): config (NULL: nothing armed), target and count, all borrowed. */
static inline void
arm_pick(const ThreadArm *arm, ArmState *state, PyObject **config, PyObject **target,
         RegionCount **count)
{
    ArmSaved *call = arm->calls;
    if (call != NULL && (state == NULL || state->seq <= call->seq)) {
        *config = call->config;
        *target = call->target;
        *count = &call->count;
    }
    else if (state != NULL) {
        *config = state->config;
        *target = state->target;
        *count = &state->count;
    }
    else {
        *config = NULL;
        *target = NULL;
        *count = NULL;
    }
}

/* The innermost region of this thread: its config (NULL: nothing armed), target
 * and count, all borrowed.  Runs no Python. */
static inline int
arm_resolve_region(PyThreadState *ts, PyObject **config, PyObject **target,
                   RegionCount **count)
{
    ThreadArm *arm = &arm_thread;
    ArmState *state = arm->state;
    if (arm->ts_id != nns_thread_id(ts) || arm->ctx_ver != nns_thread_context_version(ts) ||
        (state != NULL && !state->active)) {
        if (arm_thread_refresh(ts, arm, &state) < 0) {
            return -1;
        }
    }
    arm_pick(arm, state, config, target, count);
    return 0;
}

/* The hook's fast path: the region last resolved, for one thread state in one
 * context, kept in a process-wide slot (GIL-protected) so that the next frame of
 * the same thread finds it without a thread-local read.  Filled by arm_hot_fill
 * after a full resolve; emptied by every change to any region (a call region pushed
 * or popped, a context region armed, disarmed or closed), so that `config` and
 * `target` (borrowed) are what arm_resolve would return while it matches.  Threads
 * taking turns refill it once per switch. */
typedef struct {
    PyThreadState *ts;       /* NULL: empty */
    uint64_t ts_id;          /* with the pointer: a thread state freed and another made
                              * at its address do not match */
    uint64_t ctx_ver;
    PyObject *config;        /* borrowed, never NULL: a region is armed */
    PyObject *target;        /* borrowed or NULL */
} ArmHot;

extern ArmHot arm_hot;

static inline void
arm_hot_forget(void)
{
    arm_hot.ts = NULL;
}

/* Remember what arm_resolve(ts) just returned (an armed config). */
static inline void
arm_hot_fill(PyThreadState *ts, PyObject *config, PyObject *target)
{
    arm_hot.ts = ts;
    arm_hot.ts_id = nns_thread_id(ts);
    arm_hot.ctx_ver = nns_thread_context_version(ts);
    arm_hot.config = config;
    arm_hot.target = target;
}

/* 1 with this thread's armed config and target (borrowed) when the slot holds
 * them, 0 when it does not (arm_resolve has the answer).  No thread-local read, no
 * call; runs no Python, never raises. */
static inline int
arm_resolve_hot(PyThreadState *ts, PyObject **config, PyObject **target)
{
    if (arm_hot.ts != ts || arm_hot.ts_id != nns_thread_id(ts) ||
        arm_hot.ctx_ver != nns_thread_context_version(ts)) {
        return 0;
    }
    *config = arm_hot.config;
    *target = arm_hot.target;
    return 1;
}

/* arm_resolve_region without the count: this thread's config and target
 * (borrowed).  Runs no Python. */
static inline int
arm_resolve(PyThreadState *ts, PyObject **config, PyObject **target)
{
    RegionCount *count;
    return arm_resolve_region(ts, config, target, &count);
}

#endif
