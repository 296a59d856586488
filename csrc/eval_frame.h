/* eval_frame.h - the PEP 523 hook and arming.
 *
 * The hook is installed only while at least one armed region is open (a count of
 * regions); whatever evaluator was installed before is restored when the count
 * drops to zero, so Python code outside armed regions runs on CPython's own
 * evaluator with all its specialisations.
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
 * by the thread's context version, so the per-frame cost stays a few loads.
 */
#ifndef NNSCALER_EVAL_FRAME_H
#define NNSCALER_EVAL_FRAME_H

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
} ArmSaved;

/* Module init: create the ContextVar and ready the types.  0, or -1 with an
 * exception set. */
int eval_frame_init(PyObject *module);

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
 * failed, which cannot happen once a context exists. */
int arm_current(PyObject **config, PyObject **target);

/* Borrowed home list of this thread's innermost region when it is a call region
 * pushed with one, else NULL.  Runs no Python, never raises. */
PyObject *arm_current_home(PyThreadState *ts);

/* 1 while the hook is installed in this interpreter. */
int eval_frame_installed(void);
/* Number of armed regions open right now (context regions whose token is live,
 * plus call regions on any thread's stack).  0 means the hook is uninstalled. */
Py_ssize_t eval_frame_armed_regions(void);

/* Calls `callable` with the frame-style argument slots of `code` rebound as a
 * normal call: positional parameters, *args items, keyword-only parameters and
 * **kwargs items.  New reference, NULL on error.  Runs Python (the callee). */
PyObject *call_with_slots(PyObject *callable, PyCodeObject *code, PyObject *const *slots);

/* Number of argument slots of `code`: parameters, plus *args and **kwargs. */
Py_ssize_t code_arg_slots(PyCodeObject *code);

/* A new function running `code` with the globals and closure of `func`. New ref.
 * Runs no Python code. */
PyObject *function_with_code(PyObject *func, PyObject *code);

extern PyTypeObject ArmToken_Type;

#endif
