/* compat_shared.c - compat-layer code written once for every CPython version.
 *
 *   - the evaluator bracket (nns_frame_run_enter/leave), which decides whether a
 *     frame must be cleared and popped by us (compat.h), and the hand-over to
 *     CPython's evaluator;
 *   - the thread state's trace flag and recursion counter;
 *   - the dict-change tracker behind nns_dict_version() on 3.12+, built on the
 *     public dict-watcher API (PyDict_AddWatcher, PEP 509's successor);
 *   - which types read an attribute from the instance __dict__ without Python
 *     (nns_type_reads_instance_dict), on _PyType_Lookup and tp_version_tag, the
 *     same in 3.11-3.14.
 * No CPython internals here, only the public (if unstable) API and the
 * PyThreadState fields of Include/cpython/pystate.h: the per-version files hold the
 * internals.
 */
#include "compat.h"

/* ---------------------------------------------------------------- frame runs */

/* Innermost open bracket of this thread (a chain through the C stack). */
static _Thread_local NnsFrameRun *current_run;

void
nns_frame_run_enter(NnsFrameRun *run, NnsFrame *frame)
{
    run->frame = frame;
    run->handed = 0;
    run->outer = current_run;
    run->args = NULL;
    current_run = run;
}

NnsFrameRun *
nns_frame_run_of(NnsFrame *frame)
{
    return current_run != NULL && current_run->frame == frame ? current_run : NULL;
}

void
nns_frame_run_mark_handed(NnsFrame *frame)
{
    /* Only the innermost bracket can own `frame`: a frame the default evaluator runs
     * for a nested call has its own bracket, or none (the unarmed fast path). */
    if (current_run != NULL && current_run->frame == frame) {
        current_run->handed = 1;
    }
}

PyObject *
nns_frame_run_leave(PyThreadState *ts, NnsFrameRun *run, PyObject *result)
{
    current_run = run->outer;
    if (run->args != run->args_small) {
        PyMem_Free(run->args);
    }
    run->args = NULL;
    if (!run->handed) {
        nns_frame_clear_and_pop(ts, run->frame);
    }
    return result;
}

PyObject *
nns_eval_frame_default(PyThreadState *ts, NnsFrame *frame, int throw_flag)
{
    nns_frame_run_mark_handed(frame);
    return _PyEval_EvalFrameDefault(ts, frame, throw_flag);
}

/* ---------------------------------------------------------------- the thread */

int
nns_thread_in_trace_callback(PyThreadState *ts)
{
    /* tstate->tracing is raised while a trace/profile function runs
     * (Include/cpython/pystate.h, 3.11-3.14). */
    return ts->tracing > 0;
}

/* The counter behind sys.getrecursionlimit() (Include/cpython/pystate.h).  3.11:
 * recursion_remaining counts down from recursion_limit, charged by Python frames
 * (_Py_EnterRecursivePy) and C recursive calls (_Py_EnterRecursiveCallTstate)
 * alike (v3.11.7).  3.12 gave Python frames a counter of their own (gh-91079):
 * py_recursion_remaining counts down from py_recursion_limit, charged by Python
 * frames only (v3.12.1, v3.13.15, v3.14.10); C calls charge c_recursion_remaining
 * on 3.12 and 3.13, and 3.14 bounds C recursion by a stack-pointer check, which
 * this touches neither of. */
#if NNS_PY_MINOR == 11
#  define RECURSION_LIMIT(ts) ((ts)->recursion_limit)
#  define RECURSION_REMAINING(ts) ((ts)->recursion_remaining)
#else
#  define RECURSION_LIMIT(ts) ((ts)->py_recursion_limit)
#  define RECURSION_REMAINING(ts) ((ts)->py_recursion_remaining)
#endif

int
nns_recursion_used(PyThreadState *ts)
{
    return RECURSION_LIMIT(ts) - RECURSION_REMAINING(ts);
}

void
nns_recursion_credit(PyThreadState *ts, int units)
{
    RECURSION_REMAINING(ts) += units;
}

/* 3.11's C-call charge includes a METH_NOARGS builtin's call (compat.h). */
const int nns_recursion_builtin_call_units = NNS_PY_MINOR == 11 ? 1 : 0;

/* ---------------------------------------------------------------- dict changes */

#ifdef NNS_DICT_CLOCK

/* Open-addressing table, dict address -> number given at its last change.  Keys are
 * addresses only (no references): the watcher removes a dict when it is freed. */
typedef struct {
    PyObject *dict;     /* NULL: empty; TOMBSTONE: removed */
    uint64_t version;
} WatchSlot;

#define TOMBSTONE ((PyObject *)1)

static WatchSlot *watch_slots;
static size_t watch_cap;        /* power of two, or 0 */
static size_t watch_used;       /* live + tombstones */
static uint64_t watch_clock;    /* last number handed out */
static int watcher_id = -1;

static size_t
slot_hash(PyObject *dict)
{
    uintptr_t h = (uintptr_t)dict >> 4;
    return (size_t)(h ^ (h >> 17) ^ (h >> 31));
}

/* The slot holding `dict`, or NULL. */
static WatchSlot *
watch_find(PyObject *dict)
{
    if (watch_cap == 0) {
        return NULL;
    }
    for (size_t i = slot_hash(dict) & (watch_cap - 1);; i = (i + 1) & (watch_cap - 1)) {
        if (watch_slots[i].dict == dict) {
            return &watch_slots[i];
        }
        if (watch_slots[i].dict == NULL) {
            return NULL;
        }
    }
}

/* Rebuild with room for `need` entries; 0 / -1 (no memory, table unchanged). */
static int
watch_grow(size_t need)
{
    size_t cap = 64;
    while (cap < 2 * need + 2) {
        cap *= 2;
    }
    WatchSlot *slots = PyMem_RawCalloc(cap, sizeof(WatchSlot));
    if (slots == NULL) {
        return -1;
    }
    size_t used = 0;
    for (size_t k = 0; k < watch_cap; k++) {
        PyObject *d = watch_slots[k].dict;
        if (d == NULL || d == TOMBSTONE) {
            continue;
        }
        size_t i = slot_hash(d) & (cap - 1);
        while (slots[i].dict != NULL) {
            i = (i + 1) & (cap - 1);
        }
        slots[i] = watch_slots[k];
        used++;
    }
    PyMem_RawFree(watch_slots);
    watch_slots = slots;
    watch_cap = cap;
    watch_used = used;
    return 0;
}

/* Insert `dict` (not present); NULL when out of memory. */
static WatchSlot *
watch_insert(PyObject *dict)
{
    if ((watch_used + 1) * 2 > watch_cap && watch_grow(watch_used + 1) < 0) {
        return NULL;
    }
    size_t i = slot_hash(dict) & (watch_cap - 1);
    while (watch_slots[i].dict != NULL && watch_slots[i].dict != TOMBSTONE) {
        i = (i + 1) & (watch_cap - 1);
    }
    if (watch_slots[i].dict == NULL) {
        watch_used++;
    }
    watch_slots[i].dict = dict;
    return &watch_slots[i];
}

static int
on_dict_event(PyDict_WatchEvent event, PyObject *dict, PyObject *Py_UNUSED(key),
              PyObject *Py_UNUSED(new_value))
{
    WatchSlot *slot = watch_find(dict);
    if (slot == NULL) {
        ++watch_clock;   /* not in the table (cannot happen): every check runs in full */
        return 0;
    }
    if (event == PyDict_EVENT_DEALLOCATED) {
        slot->dict = TOMBSTONE;
        ++watch_clock;   /* nns_dict_clock: any watched dict's change moves it */
    }
    else {
        slot->version = ++watch_clock;
    }
    return 0;
}

uint64_t
nns_dict_clock(void)
{
    return watch_clock;
}

uint64_t
nns_dict_version(PyObject *dict)
{
    WatchSlot *slot = watch_find(dict);
    if (slot != NULL) {
        return slot->version;
    }
    /* Not known yet: start watching.  Every failure returns a fresh number (the
     * guard then never matches) and leaves no exception behind. */
    PyObject *exc = PyErr_GetRaisedException();
    if (watcher_id < 0) {
        watcher_id = PyDict_AddWatcher(on_dict_event);
    }
    if (watcher_id >= 0 && (slot = watch_insert(dict)) != NULL) {
        if (PyDict_Watch(watcher_id, dict) == 0) {
            slot->version = ++watch_clock;
            PyErr_SetRaisedException(exc);
            return slot->version;
        }
        slot->dict = TOMBSTONE;
    }
    PyErr_Clear();
    PyErr_SetRaisedException(exc);
    return ++watch_clock;
}

int
nns_dict_watched(PyObject *dict)
{
    if (watch_find(dict) != NULL) {
        return 1;
    }
    (void)nns_dict_version(dict);   /* leaves no slot when watching fails */
    return watch_find(dict) != NULL;
}

#else /* no dict clock: 3.11 */

/* 3.11 has no clock: its dict versions are summed instead (compat_objects.h,
 * NNS_DICT_TAGS_MONOTONIC), and nns_dict_version is inline there. */
uint64_t
nns_dict_clock(void)
{
    return 0;
}

int
nns_dict_watched(PyObject *Py_UNUSED(dict))
{
    return 0;
}

#endif /* NNS_DICT_CLOCK */

/* ------------------------------------------------- plain instance attributes */

/* A direct-mapped cache: (type, name) -> decision, valid while the type's version
 * tag is the one recorded.  CPython gives a type a new tag (from a global counter,
 * never reused) after any change to it or its bases, and 0 while it has none. */
#define PLAIN_ATTR_SLOTS 64

typedef struct {
    PyTypeObject *type;
    PyObject *name;
    unsigned int tag;
    int plain;
} PlainAttrSlot;

static PlainAttrSlot plain_attr_cache[PLAIN_ATTR_SLOTS];
static PyObject *getattribute_name;     /* "__getattribute__", interned */
static PyObject *object_getattribute;   /* object.__getattribute__'s descriptor */

static int
reads_instance_dict_uncached(PyTypeObject *tp, PyObject *name)
{
    if (getattribute_name == NULL) {
        if ((getattribute_name = PyUnicode_InternFromString("__getattribute__")) == NULL) {
            PyErr_Clear();
            return 0;
        }
        object_getattribute = Py_XNewRef(_PyType_Lookup(&PyBaseObject_Type, getattribute_name));
    }
    if (object_getattribute == NULL ||
        _PyType_Lookup(tp, getattribute_name) != object_getattribute) {
        return 0;
    }
    PyObject *attr = _PyType_Lookup(tp, name);
    return attr == NULL || Py_TYPE(attr)->tp_descr_set == NULL;
}

int
nns_type_reads_instance_dict(PyTypeObject *tp, PyObject *name)
{
    size_t i = (((uintptr_t)tp >> 4) ^ ((uintptr_t)name >> 4)) % PLAIN_ATTR_SLOTS;
    PlainAttrSlot *slot = &plain_attr_cache[i];
    if (slot->type == tp && slot->name == name && slot->tag == tp->tp_version_tag &&
        slot->tag != 0) {
        return slot->plain;
    }
    int plain = reads_instance_dict_uncached(tp, name);   /* may assign a tag */
    if (tp->tp_version_tag != 0) {
        slot->type = tp;
        slot->name = name;
        slot->tag = tp->tp_version_tag;
        slot->plain = plain;
    }
    return plain;
}
