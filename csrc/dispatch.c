/* dispatch.c - the capture-mode path of the frame evaluator.
 *
 * Hit:  key (C) -> bucket of (config, owner) -> entry with equal key and holding
 *       guards -> runner(*slots, *training_flags).  No Python code of this project
 *       runs; the user's can (tensor-subclass getters, `training` properties), so
 *       the bucket, the entry and the config are held across it.
 *       The owner is `self` for a module forward, the frame's function object for
 *       a compiled function (held weakly by the bucket, as `self` is).
 * Miss: convert_frame(config, fn, code, self, slots, bucket, key) in Python, with the
 *       hook suspended for this thread; it runs the forward once for real (its result
 *       is the call's result) and returns (result, CacheEntry or None), or
 *       (run_eagerly, None) to have the frame evaluated here.  `key` is the call key
 *       (a CallKey: convert_frame describes it with describe_call_key), built once:
 *       the lookup's when it is still good (handle_miss), and stored with the entry.
 */
#include "dispatch.h"
#include "frameobject.h"
#include "cache.h"
#include "cache_table.h"
#include "frame_record.h"
#include "call_key.h"
#include "call_key_reader.h"
#include "arming.h"
#include "frame_calls.h"
#include "nns_globals.h"

/* ------------------------------------------------------- buckets per config */

/* Borrowed live bucket of (`owner`, `config`), or NULL.  Runs no Python. */
static CacheBucket *
find_bucket(CodeState *cs, PyObject *config, PyObject *owner)
{
    CacheTable *table = cache_tables_find(&cs->tables, config);
    return table ? cache_table_find(table, owner) : NULL;
}

/* ------------------------------------------------------------------- runner */

/* Calls the entry's runner with the slots and the training flags it takes.
 * `entry` and `slots` are owned by the caller for the whole call.  Reading a flag
 * may run Python (a `training` property); a module collected meanwhile makes the
 * entry unusable: NULL with no exception and *stale set. */
static PyObject *
call_runner(CacheEntry *entry, PyObject *const *slots, Py_ssize_t n, int *stale)
{
    PyObject *small[24];
    PyObject **args = small;
    PyObject *result = NULL;
    Py_ssize_t nflags = PyTuple_GET_SIZE(entry->training_refs);
    Py_ssize_t total = n + nflags;

    *stale = 0;
    if (nflags == 0) {
        return PyObject_Vectorcall(entry->runner, slots, (size_t)n, NULL);
    }
    if (total > (Py_ssize_t)(sizeof(small) / sizeof(small[0]))) {
        args = PyMem_Malloc(sizeof(PyObject *) * (size_t)total);
        if (args == NULL) {
            return PyErr_NoMemory();
        }
    }
    memcpy(args, slots, sizeof(PyObject *) * (size_t)n);
    uint64_t clock = nns_dict_clock();
    for (Py_ssize_t i = 0; i < nflags; i++) {
        /* The guards saw every module alive, but reading an earlier flag may have
         * run Python that dropped this one (cache_flag holds it across a read that
         * may run Python). */
        PyObject *module = nns_weakref_object(PyTuple_GET_ITEM(entry->training_refs, i));
        if (module == Py_None) {
            *stale = 1;
            goto done;
        }
        PyObject *flag = cache_flag(&entry->flag_reads[i], module, &clock);   /* borrowed */
        if (flag == NULL) {
            goto done;
        }
        args[n + i] = flag;
    }
    result = PyObject_Vectorcall(entry->runner, args, (size_t)total, NULL);
done:
    if (args != small) {
        PyMem_Free(args);
    }
    return result;
}

static int
is_internal_frame(PyTracebackObject *tb)
{
    PyCodeObject *code = PyFrame_GetCode(tb->tb_frame);   /* new reference */
    int internal = nns_globals.internal_prefix != NULL &&
                   PyUnicode_Tailmatch(code->co_filename, nns_globals.internal_prefix, 0,
                                       PY_SSIZE_T_MAX, -1) == 1;
    Py_DECREF(code);
    return internal;
}

/* The user's exception passed through convert_frame and the tracer: unlink their
 * frames (files under nnscaler_eval/) from the traceback, so that it reads
 * "your call -> your forward line -> the error", as in eager.  Keeps the original
 * traceback if anything goes wrong. */
static void
strip_internal_frames(void)
{
    PyObject *type, *value, *tb;
    PyObject *kept = NULL;   /* owned list */
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb == NULL || (kept = PyList_New(0)) == NULL) {
        goto restore;
    }
    for (PyTracebackObject *cur = (PyTracebackObject *)tb; cur != NULL; cur = cur->tb_next) {
        if (!is_internal_frame(cur) && PyList_Append(kept, (PyObject *)cur) < 0) {
            goto restore;
        }
    }
    Py_ssize_t n = PyList_GET_SIZE(kept);
    if (n == 0) {
        goto restore;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTracebackObject *t = (PyTracebackObject *)PyList_GET_ITEM(kept, i);
        PyObject *next = i + 1 < n ? Py_NewRef(PyList_GET_ITEM(kept, i + 1)) : NULL;
        Py_XSETREF(t->tb_next, (PyTracebackObject *)next);
    }
    Py_SETREF(tb, Py_NewRef(PyList_GET_ITEM(kept, 0)));
    if (value != NULL) {
        PyException_SetTraceback(value, tb);
    }
restore:
    PyErr_Clear();   /* a failed list append: keep the traceback as it was */
    Py_XDECREF(kept);
    PyErr_Restore(type, value, tb);
}

/* What a capture changes on this thread and must leave as it found it: torch's
 * function-mode stack (the tracer is a mode) and the record of functions run.  The
 * tracer restores both itself, in Python; but a KeyboardInterrupt raised by a signal
 * handler can land at the entry of any `finally` there (measured: about one in 200
 * interrupted first calls left the tracer's mode on).  Here, in C, calling only C
 * builtins, no signal handler runs between the steps. */
typedef struct {
    Py_ssize_t mode_depth;    /* -1: unknown (then not restored) */
    PyObject *recording;      /* owned: this thread's record set at entry, or NULL */
} CaptureThreadState;

static Py_ssize_t
mode_stack_depth(void)
{
    PyObject *n = PyObject_CallNoArgs(nns_globals.len_torch_function_stack);
    Py_ssize_t depth = n != NULL ? PyLong_AsSsize_t(n) : -1;
    Py_XDECREF(n);
    if (depth < 0) {
        PyErr_Clear();
    }
    return depth;
}

static void
capture_state_save(CaptureThreadState *state)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    state->mode_depth = mode_stack_depth();
    state->recording = Py_XNewRef(frame_record_set);
    PyErr_Restore(type, value, tb);
}

/* Never fails; keeps a pending exception (the user's, or an interrupt). */
static void
capture_state_restore(CaptureThreadState *state)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    /* What an interrupt left half done was finished by convert_frame itself
     * (capture/unwinding.py), before this restore. */
    for (int popped = 0; state->mode_depth >= 0 && popped < 64; popped++) {
        Py_ssize_t depth = mode_stack_depth();
        if (depth < 0 || depth <= state->mode_depth) {
            break;
        }
        PyObject *mode = PyObject_CallNoArgs(nns_globals.pop_torch_function_stack);
        if (mode == NULL) {
            PyErr_Clear();
            break;
        }
        Py_DECREF(mode);
    }
    if (frame_record_set != state->recording) {
        Py_XDECREF(frame_record_replace(state->recording));   /* moves our reference */
    }
    else {
        Py_XDECREF(state->recording);
    }
    state->recording = NULL;
    PyErr_Restore(type, value, tb);
}

/* A target frame with no valid entry: convert_frame captures it (or says to run
 * it eagerly).  `self` (borrowed from the frame) is the module or NULL, `owner`
 * (borrowed from the frame) the bucket's owner, `config` and `bucket` (bucket may
 * be NULL) are held by the caller.  `built` is the key dispatch_capture built for
 * the lookup, to be taken over, or NULL: build it here.  Runs Python. */
static PyObject *
handle_miss(PyThreadState *ts, NnsFrame *frame, PyCodeObject *code, CodeState *cs,
            PyObject *self, PyObject *owner, PyObject *config, CacheBucket *bucket,
            Py_ssize_t n, CallKey *built)
{
    PyObject *result = NULL;
    /* owned */
    PyObject *fn = NULL, *slot_tuple = NULL, *reply = NULL;
    CacheTable *table = NULL;
    CacheBucket *held = NULL;
    CallKeyObject *key = NULL;
    /* borrowed: the frame's own, stable until it returns */
    PyObject **slots = nns_frame_localsplus(frame);
    Py_ssize_t skip = self != NULL;

    if (slots == NULL) {   /* read before, in this bracket: cannot fail (compat.h) */
        goto internal_error;
    }
    if (built != NULL) {
        /* The key is built once.  The lookup's was built from these slots, and no
         * code ran since its build began (no CALL_KEY_RAN_PYTHON: no tensor-subclass
         * getter, no container snapshot and so no GC, no guard check, no bucket
         * change), so it still describes the arguments, and every address in it is
         * still the object the build read there.  It gets the pins a stored key needs
         * first, before anything here allocates a Python object (the GC could run
         * finalizers); what runs after that is as after a build here. */
        if (call_key_pin_from_bytes(built) < 0) {
            goto internal_error;
        }
    }
    if (bucket != NULL) {
        held = (CacheBucket *)Py_NewRef(bucket);   /* convert_frame may reset() */
    }
    else if ((table = cache_tables_ensure(&cs->tables, config)) == NULL ||
             (held = cache_table_add(table, owner, arm_current_home(ts))) == NULL) {
        goto internal_error;
    }
    held->misses++;
    if ((key = call_key_object_new()) == NULL) {
        goto internal_error;
    }
    if (built != NULL) {
        call_key_move(&key->key, built);
    }
    else if (call_key_build(&key->key, slots + skip, n - skip) < 0) {
        goto internal_error;
    }
    PyObject *func = nns_frame_function(frame);
    if (func == NULL || !PyFunction_Check(func)) {
        PyErr_SetString(PyExc_RuntimeError, "frame has no function object");
        goto internal_error;
    }
    fn = cs->rewritten ? function_with_code(func, cs->rewritten) : Py_NewRef(func);
    if (fn == NULL) {
        goto internal_error;
    }
    slot_tuple = PyTuple_New(n);
    if (slot_tuple == NULL) {
        goto internal_error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTuple_SET_ITEM(slot_tuple, i, Py_NewRef(slots[i]));
    }
    /* Reentrancy: convert_frame runs the user's forward (arbitrary Python). It may
     * arm/disarm, call other compiled modules, reset() caches, or raise.  Capture
     * is suspended for this thread meanwhile (a call region in rewrite mode), so
     * that the trace sees plain frames, rewritten. */
    ArmSaved suspended;
    CaptureThreadState before;
    capture_state_save(&before);
    arm_push(&suspended, nns_globals.rewrite_mode, NULL);
    PyObject *callargs[] = {config, fn, (PyObject *)code, self ? self : Py_None,
                            slot_tuple, (PyObject *)held, (PyObject *)key};
    reply = PyObject_Vectorcall(nns_globals.convert_frame, callargs, 7, NULL);
    arm_pop(&suspended);
    capture_state_restore(&before);
    if (reply == NULL) {
        /* convert_frame lets the user's own exceptions through and turns its own
         * failures into a warning + run_eagerly; anything here is the user's. */
        strip_internal_frames();
        goto done;
    }
    if (!PyTuple_Check(reply) || PyTuple_GET_SIZE(reply) != 2) {
        PyErr_SetString(PyExc_TypeError, "convert_frame must return (result, entry)");
        goto internal_error;
    }
    PyObject *value = PyTuple_GET_ITEM(reply, 0);   /* borrowed from reply */
    PyObject *entry = PyTuple_GET_ITEM(reply, 1);
    if (entry != Py_None) {
        if (!PyObject_TypeCheck(entry, &CacheEntry_Type)) {
            PyErr_SetString(PyExc_TypeError, "convert_frame returned a non-CacheEntry");
            goto internal_error;
        }
        /* If a reset() dropped the bucket meanwhile, the entry goes with it. */
        if (cache_insert(held, (CacheEntry *)entry, &key->key) < 0) {
            goto internal_error;
        }
    }
    if (value == nns_globals.run_eagerly) {
        held->fallbacks++;
        result = frame_run_eagerly(ts, frame, cs);
    }
    else if (value == nns_globals.run_disarmed) {
        /* cache_size_limit reached: this call and everything it calls run as in
         * eager (callees are not captured one by one either). */
        held->fallbacks++;
        ArmSaved disarmed;
        arm_push(&disarmed, nns_globals.rewrite_mode, NULL);
        result = frame_run_eagerly(ts, frame, cs);
        arm_pop(&disarmed);
    }
    else {
        result = Py_NewRef(value);
    }
    goto done;

internal_error:
    if (nns_report_internal_error("capture") < 0) {
        goto done;
    }
    if (reply != NULL && PyTuple_Check(reply) && PyTuple_GET_SIZE(reply) == 2 &&
        PyTuple_GET_ITEM(reply, 0) != nns_globals.run_eagerly) {
        /* The forward already ran inside convert_frame: hand back its result rather
         * than running it (and its side effects) a second time. */
        result = Py_NewRef(PyTuple_GET_ITEM(reply, 0));
    }
    else {
        result = frame_run_eagerly(ts, frame, cs);
    }
done:
    Py_XDECREF(key);
    Py_XDECREF(fn);
    Py_XDECREF(slot_tuple);
    Py_XDECREF(reply);
    Py_XDECREF(table);
    Py_XDECREF(held);
    return result;
}

/* The hit lookup both entries share: builds `key` over slots[skip:n] and returns the
 * matching entry of `*bucket` (new reference), or NULL: no entries, no match, or the
 * bucket was reset or replaced meanwhile (then *bucket is cleared and the key marked
 * as having run Python).  -1 on error (exception set).  `*bucket` is owned by the
 * caller.  Runs Python: tensor-subclass getters, training properties in guards. */
static int
lookup_entry(CodeState *cs, PyObject *config, PyObject *owner, CacheBucket **bucket,
             CallKey *key, PyObject *const *slots, Py_ssize_t n, Py_ssize_t skip,
             CacheEntry **entry)
{
    *entry = NULL;
    /* entries is NULL only if the self-collected callback ran out of memory */
    if (*bucket == NULL || (*bucket)->entries == NULL ||
        PyList_GET_SIZE((*bucket)->entries) == 0) {
        return 0;
    }
    /* Reentrancy: tensor-subclass getters run Python here; it may reset() the caches
     * or delete modules.  The caller holds the bucket; if it is no longer the live
     * bucket of this owner afterwards, this is a miss. */
    if (call_key_build(key, slots + skip, n - skip) < 0) {
        return -1;
    }
    if (find_bucket(cs, config, owner) != *bucket) {
        key->flags |= CALL_KEY_RAN_PYTHON;   /* something reset() or replaced it */
        Py_CLEAR(*bucket);
        return 0;
    }
    /* Guard checks may read training properties (Python); the entry is held from
     * the moment it is returned. */
    *entry = cache_lookup(*bucket, key);
    Py_XINCREF(*entry);
    return 0;
}

int
dispatch_hit_by_slots(CodeState *cs, PyObject *config, PyObject *self,
                      PyObject *const *slots, Py_ssize_t n, PyObject **result)
{
    int done = 0;
    CacheEntry *entry = NULL;
    CallKey key;
    call_key_init(&key, 0);
    CacheBucket *bucket = find_bucket(cs, config, self);   /* owned below */
    Py_XINCREF(bucket);
    if (bucket == NULL || cache_bucket_runs_eagerly(bucket, slots + 1, n - 1)) {
        goto out;   /* the frame path counts the fallback */
    }
    if (lookup_entry(cs, config, self, &bucket, &key, slots, n, 1, &entry) < 0) {
        PyErr_Clear();   /* the frame path meets it again and reports it */
        goto out;
    }
    if (entry == NULL || entry->runner == NULL) {
        goto out;   /* a miss or a recorded fallback */
    }
    int stale;
    PyObject *r = call_runner(entry, slots, n, &stale);
    if (stale) {
        goto out;
    }
    entry->hits++;
    bucket->hits++;
    *result = r;
    done = 1;
out:
    call_key_release(&key);
    Py_XDECREF(entry);
    Py_XDECREF(bucket);
    return done;
}

PyObject *
dispatch_capture(PyThreadState *ts, NnsFrame *frame, PyCodeObject *code, CodeState *cs,
                 PyObject *self, PyObject *config)
{
    PyObject *result = NULL;
    /* owned: each can be released by Python run below (key getters, flag reads) */
    CacheBucket *bucket = NULL;
    CacheEntry *entry = NULL;
    PyObject *held_config = Py_NewRef(config);
    /* borrowed: the frame's own, stable until it returns */
    PyObject **slots = nns_frame_localsplus(frame);
    PyObject *owner = self != NULL ? self : nns_frame_function(frame);
    Py_ssize_t n = code_arg_slots(code);
    Py_ssize_t skip = self != NULL;
    CallKey key;
    call_key_init(&key, 0);

    if (slots == NULL) {   /* read before, in this bracket: cannot fail (compat.h) */
        goto internal_error;
    }
    if (owner == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "frame has no function object");
        goto internal_error;
    }
    bucket = find_bucket(cs, config, owner);
    Py_XINCREF(bucket);
    if (bucket != NULL && cache_bucket_runs_eagerly(bucket, slots + skip, n - skip)) {
        /* An argument type this forward cannot take as a graph input (recorded by
         * convert_frame with its reason): no key, no entry, callees intercepted. */
        bucket->fallbacks++;
        result = frame_run_eagerly(ts, frame, cs);
        goto done;
    }
    if (lookup_entry(cs, config, owner, &bucket, &key, slots, n, skip, &entry) < 0) {
        goto internal_error;
    }
    if (entry != NULL) {
        entry->hits++;
        if (entry->runner == NULL) {
            /* A recorded fallback: this key runs eagerly, its callees still
             * intercepted. Counted as a fallback, not a hit. */
            bucket->fallbacks++;
            result = frame_run_eagerly(ts, frame, cs);
        }
        else {
            int stale;
            bucket->hits++;
            result = call_runner(entry, slots, n, &stale);
            if (stale) {
                bucket->hits--;
                bucket->fallbacks++;
                result = frame_run_eagerly(ts, frame, cs);
            }
        }
        goto done;
    }
    /* A miss.  The key built for the lookup is this call's key unless code ran
     * since its build began (see handle_miss). */
    CallKey *built = key.len > 0 && !(key.flags & CALL_KEY_RAN_PYTHON) ? &key : NULL;
    if (built == NULL) {
        call_key_release(&key);
    }
    result = handle_miss(ts, frame, code, cs, self, owner, held_config, bucket, n, built);
    goto done;

internal_error:
    if (nns_report_internal_error("computing the call key") < 0) {
        goto done;
    }
    result = frame_run_eagerly(ts, frame, cs);
done:
    call_key_release(&key);
    Py_XDECREF(entry);
    Py_XDECREF(bucket);
    Py_DECREF(held_config);
    return result;
}
