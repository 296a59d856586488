/* dispatch.c - the capture-mode path of the frame evaluator.
 *
 * Hit:  key (C) -> bucket of `self` -> entry with equal key and holding guards ->
 *       runner(*slots, *training_flags).  No Python code of this project runs.
 * Miss: convert_frame(config, fn, code, self, slots, bucket) in Python, with the hook
 *       suspended for this thread; it runs the forward once for real (its result is
 *       the call's result) and returns (result, CacheEntry or None), or
 *       (run_eagerly, None) to have the frame evaluated here.
 */
#include "dispatch.h"
#include "frameobject.h"
#include "cache.h"
#include "call_key.h"
#include "eval_frame.h"
#include "nns_globals.h"

static PyObject *
call_runner(CacheEntry *entry, PyObject *const *slots, Py_ssize_t n)
{
    PyObject *small[24];
    PyObject **args = small;
    PyObject *result = NULL;
    Py_ssize_t nflags = PyTuple_GET_SIZE(entry->training_refs);
    Py_ssize_t total = n + nflags;

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
    for (Py_ssize_t i = 0; i < nflags; i++) {
        /* Liveness was checked by the guards; a borrowed bool is enough here. */
        PyObject *module = nns_weakref_object(PyTuple_GET_ITEM(entry->training_refs, i));
        PyObject *flag = cache_read_training(module);
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

static PyObject *
handle_miss(PyThreadState *ts, NnsFrame *frame, PyCodeObject *code, CodeState *cs,
            PyObject *self, PyObject *config, CacheBucket *bucket, Py_ssize_t n)
{
    PyObject *result = NULL;
    PyObject *fn = NULL, *slot_tuple = NULL, *reply = NULL;   /* owned */
    PyObject **slots = nns_frame_localsplus(frame);
    Py_ssize_t skip = self != NULL;
    CallKey key;
    call_key_init(&key, 1);

    if (bucket == NULL && (bucket = cache_new_bucket(&cs->buckets, self)) == NULL) {
        goto internal_error;
    }
    Py_INCREF(bucket);   /* convert_frame may run code that prunes the bucket list */
    bucket->misses++;
    if (call_key_build(&key, slots + skip, n - skip) < 0) {
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
     * arm/disarm, call other compiled modules, or raise; our hook is suspended for
     * this thread meanwhile so that the trace sees plain frames. */
    PyObject *armed = eval_frame_suspend();
    PyObject *callargs[] = {config, fn, (PyObject *)code, self ? self : Py_None,
                            slot_tuple, (PyObject *)bucket};
    reply = PyObject_Vectorcall(nns_globals.convert_frame, callargs, 6, NULL);
    eval_frame_resume(armed);
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
    PyObject *value = PyTuple_GET_ITEM(reply, 0);
    PyObject *entry = PyTuple_GET_ITEM(reply, 1);
    if (entry != Py_None) {
        if (!PyObject_TypeCheck(entry, &CacheEntry_Type)) {
            PyErr_SetString(PyExc_TypeError, "convert_frame returned a non-CacheEntry");
            goto internal_error;
        }
        if (cache_insert(bucket, (CacheEntry *)entry, &key) < 0) {
            goto internal_error;
        }
    }
    if (value == nns_globals.run_eagerly) {
        bucket->fallbacks++;
        result = eval_frame_run_eagerly(ts, frame, cs);
    }
    else if (value == nns_globals.run_disarmed) {
        /* cache_size_limit reached: this call and everything it calls run as in
         * eager (callees are not captured one by one either). */
        bucket->fallbacks++;
        PyObject *config_saved = eval_frame_suspend();
        result = eval_frame_run_eagerly(ts, frame, cs);
        eval_frame_resume(config_saved);
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
        result = eval_frame_run_eagerly(ts, frame, cs);
    }
done:
    call_key_release(&key);
    Py_XDECREF(fn);
    Py_XDECREF(slot_tuple);
    Py_XDECREF(reply);
    Py_XDECREF(bucket);
    return result;
}

PyObject *
dispatch_capture(PyThreadState *ts, NnsFrame *frame, PyCodeObject *code, CodeState *cs,
                 PyObject *self, PyObject *config)
{
    PyObject *result = NULL;
    PyObject **slots = nns_frame_localsplus(frame);
    Py_ssize_t n = code_arg_slots(code);
    Py_ssize_t skip = self != NULL;
    CacheBucket *bucket = cache_find_bucket(cs->buckets, self);   /* borrowed */
    CallKey key;
    call_key_init(&key, 0);

    /* entries is NULL only if the self-collected callback ran out of memory */
    if (bucket != NULL && bucket->entries != NULL && PyList_GET_SIZE(bucket->entries) > 0) {
        if (call_key_build(&key, slots + skip, n - skip) < 0) {
            call_key_release(&key);
            if (nns_report_internal_error("computing the call key") < 0) {
                return NULL;
            }
            return eval_frame_run_eagerly(ts, frame, cs);
        }
        CacheEntry *entry = cache_lookup(bucket, &key);
        if (entry != NULL) {
            entry->hits++;
            if (entry->runner == NULL) {
                /* A recorded fallback: this key runs eagerly, its callees still
                 * intercepted. Counted as a fallback, not a hit. */
                bucket->fallbacks++;
                result = eval_frame_run_eagerly(ts, frame, cs);
            }
            else {
                bucket->hits++;
                Py_INCREF(entry);   /* the runner may run code that drops it */
                result = call_runner(entry, slots, n);
                Py_DECREF(entry);
            }
            call_key_release(&key);
            return result;
        }
    }
    call_key_release(&key);
    return handle_miss(ts, frame, code, cs, self, config, bucket, n);
}
