/* compat_objects.h - the object-level half of the version layer: the few names that
 * read objects (dicts, weak references, instance dicts, type lookups) whose
 * internals changed between minor versions.  guards/ include this header and no
 * other of the layer; compat.h (frames, bytecode, the evaluator slot, recursion)
 * includes it for the shim.  Which CPython this is comes from compat_versions.h.
 * The functions declared without a body here are defined in compat_shared.c and
 * compat_py3XX.c.
 *
 * Ownership: unless a comment says otherwise, every function here returns a
 * BORROWED reference and never raises.
 */
#ifndef NNSCALER_COMPAT_OBJECTS_H
#define NNSCALER_COMPAT_OBJECTS_H

#include "compat_versions.h"   /* Python.h, and which CPython this is */

/* ---- dicts: "has this changed since I looked?" ---- */

/* "Has this dict changed since I looked?"  nns_dict_version(dict) returns a number;
 * a later call returns a different number if the dict was modified in between (any
 * insert, update, delete, clear or clone into it).  Numbers are never reused for
 * another dict, so a snapshot taken from a dict that was freed and whose address was
 * reused does not match the new dict.  Never raises.
 *   3.11: ma_version_tag (PEP 509), free.
 *   3.12+: version tags are deprecated (3.12, 3.13) and gone (3.14): the first call
 *   on a dict starts watching it with a PyDict watcher (one per process, never
 *   removed) and records it in a side table, dict -> number; the watcher gives the
 *   dict a new number on every change and drops it from the table when the dict is
 *   freed.  If the side table cannot grow (no memory) the call returns a fresh
 *   number each time, so a guard built on it fails closed (a cache miss). */
#ifdef NNS_PY311
/* Inline on 3.11 (a load): the state guards read one per guarded dict per hit. */
static inline uint64_t
nns_dict_version(PyObject *dict)
{
    return ((PyDictObject *)dict)->ma_version_tag;
}
#else
uint64_t nns_dict_version(PyObject *dict);
#endif

#ifdef NNS_PY311
/* 3.11 only: the version tags are MONOTONIC (PEP 509, Objects/dictobject.c of 3.11):
 * every dict creation and every modification sets ma_version_tag = ++global counter.
 * So a dict's version never goes down, and a dict created after a version v was
 * read (from any dict) has a version above v.  Hence, for dicts d_i whose versions
 * v_i were read earlier (d_i the same object since, or one made later at the same
 * address), every d_i is unchanged iff sum(nns_dict_version(d_i)) == sum(v_i): each
 * term can only have grown, so an equal sum leaves no room for any to have.  The sum
 * is kept in 128 bits (nns_tag_sum, a carry count above 64), which no count of
 * 64-bit versions overflows, so the equivalence is exact, not probable.  cache_entry.c
 * checks all of an entry's dict guards this way, a load and an add per dict and one
 * compare for all (docs/design.md, "Guards").  3.12+ have the dict clock instead
 * (below): their versions are per dict, not from one counter. */
#  define NNS_DICT_TAGS_MONOTONIC 1
typedef struct {
    uint64_t low, high;
} nns_tag_sum;

static inline void
nns_tag_sum_add(nns_tag_sum *sum, uint64_t version)
{
    /* add, then add with carry: the compilers this builds with (GCC, Clang) emit it so */
    sum->high += __builtin_add_overflow(sum->low, version, &sum->low);
}

static inline int
nns_tag_sum_equal(nns_tag_sum a, nns_tag_sum b)
{
    return a.low == b.low && a.high == b.high;
}
#endif

/* "Has any dict I took a version of changed since?"  3.12+: a number that moves
 * whenever a watched dict (one nns_dict_version was called on) changes, is freed, or
 * starts being watched, so a cache entry that saw all its dicts unchanged at clock c
 * needs no per-dict check while the clock still reads c: one comparison per entry,
 * whatever the model's depth.  3.11: 0, always (its version tags move on any dict
 * change in the process: each dict is read, their versions summed:
 * NNS_DICT_TAGS_MONOTONIC above). */
uint64_t nns_dict_clock(void);

#ifndef NNS_PY311
/* 3.12+: nns_dict_clock() is a clock (above), and the way to know a dict is
 * unchanged: PEP 699 deprecated ma_version_tag in 3.12 (gh-101193) and 3.14 removed
 * it, while the dict watchers (PyDict_AddWatcher) are new in 3.12.  On 3.11,
 * NNS_DICT_TAGS_MONOTONIC instead. */
#  define NNS_DICT_CLOCK 1
#endif

/* 1 when changes to `dict` move nns_dict_clock (it is watched now, watching it first
 * if need be), 0 when they may not (3.11, or watching failed).  Never raises. */
int nns_dict_watched(PyObject *dict);

/* ---- weak references, instance dicts, type lookups ---- */

/* The object a weak reference points to, borrowed, or Py_None once it is dead: what
 * PyWeakref_GET_OBJECT gave before 3.13 deprecated it.  Never raises. */
static inline PyObject *
nns_weakref_object(PyObject *ref)
{
#if defined(NNS_PY311) || defined(NNS_PY312)
    return PyWeakref_GET_OBJECT(ref);
#else
    /* What the deprecated macro did, from the struct in Include/cpython/
     * weakrefobject.h (unchanged 3.11-3.14): a cleared reference points to None, and
     * a referent already in its deallocator (refcount 0, weakrefs not yet cleared)
     * counts as dead, as in PyWeakref_GetRef.  No new reference taken and dropped:
     * state guards read one per module per hit. */
    PyObject *obj = ((PyWeakReference *)ref)->wr_object;
    return obj == Py_None || Py_REFCNT(obj) == 0 ? Py_None : obj;
#endif
}

/* The instance __dict__ of `obj`, borrowed, or NULL when it has none (a dict of
 * inline values is materialised first).  Runs no Python, never raises. */
static inline PyObject *
nns_object_dict(PyObject *obj)
{
    PyObject **dictptr = _PyObject_GetDictPtr(obj);
    return dictptr != NULL ? *dictptr : NULL;
}

/* Where `obj` keeps its instance __dict__ pointer, as an offset from the object,
 * when every instance of its class keeps it there (a managed dict, or a positive
 * tp_dictoffset), else 0.  Materialises a dict of inline values (as nns_object_dict).
 * Runs no Python, never raises. */
static inline Py_ssize_t
nns_object_dict_offset(PyObject *obj)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (!(tp->tp_flags & Py_TPFLAGS_MANAGED_DICT) && tp->tp_dictoffset <= 0) {
        return 0;
    }
    PyObject **dictptr = _PyObject_GetDictPtr(obj);
    return dictptr != NULL ? (Py_ssize_t)((char *)dictptr - (char *)obj) : 0;
}

/* nns_object_dict(obj) for an instance of the class `offset` was taken from
 * (nns_object_dict_offset): one load.  Runs no Python, never raises. */
static inline PyObject *
nns_object_dict_at(PyObject *obj, Py_ssize_t offset)
{
    return offset != 0 ? *(PyObject **)((char *)obj + offset) : nns_object_dict(obj);
}

/* 1 when reading attribute `name` (an interned str) of an instance of `tp` finds
 * an instance __dict__ entry first, running no Python to get there: the type's
 * __getattribute__ is object's and `name` is no data descriptor (property) on the
 * type.  Cached per (type, name) under the type's version tag, so a class changed
 * later is looked at again.  Runs no Python, never raises. */
int nns_type_reads_instance_dict(PyTypeObject *tp, PyObject *name);

/* Borrowed attribute `name` of `tp` found along its MRO without calling anything
 * (_PyType_Lookup), or NULL.  Runs no Python, never raises. */
static inline PyObject *
nns_type_lookup(PyTypeObject *tp, PyObject *name)
{
    return _PyType_Lookup(tp, name);
}

#endif /* NNSCALER_COMPAT_OBJECTS_H */
