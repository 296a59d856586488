/* cache_entry.h - a cache entry: a captured graph and its guards, and the check a
 * hit runs on them (cache_entry_check).  Entries live in buckets (cache.h).
 *
 * Guards (docs/design.md, "Guards"): training flags that were branched on are
 * compared by value (a toggle back makes the entry valid again); everything else the
 * capture depends on is a ValueGuard (value_guards.h): the module tree and hook dicts
 * of each module the trace went through (same objects under the same keys), and the
 * plain values it read (module attributes, globals, cells, ...), re-validated when
 * their dict's version moves.
 *
 * References: an entry owns its runner, the guarded dicts and value guards, weak
 * references to modules, weak references to the objects its key names by identity
 * where they can be weakly referenced (strong ones otherwise), and `info`.  Strong
 * references it holds (guarded dicts, expected values) can lead back to
 * a module or to the compiled wrapper; every one of them is traversed, and buckets
 * are owned by a GC-visible home (cache_table.h), so such cycles are collected.
 */
#ifndef NNSCALER_CACHE_ENTRY_H
#define NNSCALER_CACHE_ENTRY_H

#include "compat_objects.h"
#include "call_key.h"
#include "value_guards.h"
#include "shape_guards.h"

/* An owner-reached VG_DICT (values[index]) laid out for the hit path while the dict
 * clock has not moved: what the clock cannot vouch for, in a few loads (the owner is
 * alive, has its class, and still has the guarded dict as its __dict__).  Borrowed
 * from the guard, which owns them.
 *
 * `held`: the owner itself, when a dict this entry holds directly and guards holds it
 * (a child module under its parent's `_modules`).  While that dict is unchanged it
 * still holds the owner, so the owner is alive and the same object: the hit path
 * reads it here instead of through its weakref.  Only where the entry's dicts are
 * known unchanged first (the clock on 3.12+, the held dicts' sum on 3.11); never
 * dereferenced otherwise.  NULL for any other owner (the root module). */
typedef struct {
    PyObject *held;            /* borrowed, see above, or NULL */
    PyObject *ref;             /* the guard's weakref to the owner */
    PyTypeObject *type;        /* the owner's class when guarded */
    PyObject *dict;            /* compared by address only */
    Py_ssize_t offset;         /* nns_object_dict_offset for that class, or 0 */
    Py_ssize_t index;          /* in values */
} OwnerCheck;

/* The last read of one flag passed to the runner (training_refs[i]) that came from
 * the module's own instance __dict__: while the module has the same class, unchanged
 * (its version tag), and the same __dict__, unchanged since (3.11: its version; 3.12+:
 * the dict clock, the dict being watched), `training` reads `value` again, with no
 * lookup.  All addresses, compared only; `tag` 0 means "read it". */
typedef struct {
    PyTypeObject *type;
    unsigned int tag;          /* type->tp_version_tag at the read */
    Py_ssize_t offset;         /* nns_object_dict_offset of the module, or 0 */
    PyObject *dict;
    uint64_t version;          /* 3.11: the dict's version; 3.12+: nns_dict_clock() */
    PyObject *value;           /* Py_True or Py_False */
} FlagRead;

typedef struct {
    PyObject_HEAD
    PyObject *runner;          /* owned callable, or NULL: run the frame eagerly */
    PyObject *training_refs;   /* owned tuple of weakrefs: flags passed to the runner */
    FlagRead *flag_reads;      /* PyMem, one per training_refs item */
    Py_ssize_t n_flags;
    PyObject **flag_refs;      /* owned weakrefs to modules */
    char *flag_values;
    FlagRead *flag_guard_reads;  /* PyMem, one per flag: its last read (FlagRead) */
    Py_ssize_t n_values;
    ValueGuard *values;        /* owned guards on values the capture read */
    Py_ssize_t n_unclocked;
    Py_ssize_t *unclocked;     /* PyMem: indices of the value guards the dict clock
                                  cannot vouch for, other than the owners' dicts */
    Py_ssize_t n_owners;
    OwnerCheck *owners;        /* PyMem: the owner-reached VG_DICTs, those with `held`
                                  first (n_held_owners of them), then in guard order */
    Py_ssize_t n_held_owners;
    PyObject *guard_names;     /* owned tuple of str: flag, then value guards */
    PyObject *info;            /* owned: the Python-side description (explain) */
    unsigned char *key;        /* PyMem block, the stored call key */
    size_t key_len;
    uint64_t key_hash;
    ShapeGuards *shapes;       /* PyMem or NULL: a dynamic entry's symbolic fields and
                                  their guards (shape_guards.h); then a key matches
                                  when equal outside them and the guards hold */
    PyObject *pins;            /* owned list or NULL: objects keyed by identity, held by
                                  weakref where possible (a dead one: entry stale) */
    Py_ssize_t n_weak_pins;
    PyObject **weak_pins;      /* PyMem, borrowed from `pins` (only ever appended to): its weak references, each
                                  once (a key pins the class of every tensor: one
                                  weakref, met once per tensor), for the hit path */
    Py_ssize_t hits;
    uint64_t clean_clock;      /* nns_dict_clock() at the last check that found every
                                  dict unchanged, or 0 (compat_objects.h: 3.12+ skip the
                                  per-dict checks while the clock stays there) */
#ifdef NNS_DICT_TAGS_MONOTONIC
    /* 3.11 (no clock): every VG_DICT is checked by one sum of version tags
     * (compat_objects.h, NNS_DICT_TAGS_MONOTONIC): the owners' dicts after their
     * OwnerCheck, and these, the dicts held directly (addresses; the guards own them),
     * packed for a tight loop.  tag_sum_held / tag_sum_owned: the sums of the
     * `version`s (those its values were validated at) of the VG_DICT guards on dicts
     * held directly / reached through an owner, recomputed after a full check.  The
     * held dicts are summed and compared first: equal, they are unchanged, and so the
     * owners they hold are alive (OwnerCheck.held). */
    Py_ssize_t n_tagged;
    PyObject **tagged;         /* PyMem */
    nns_tag_sum tag_sum_held;
    nns_tag_sum tag_sum_owned;
#endif
} CacheEntry;

extern PyTypeObject CacheEntry_Type;

/* 1 when every state guard holds; 0 when a flag or a value differs (entry kept); -1
 * when a dict changed or a guarded module, tensor or pinned object died (entry stale
 * for good).  *failed gets the index of the failing guard (-1: a pin or training
 * module died).  Never raises.  May run Python (see value_guard_check): the caller
 * owns a reference to `entry`. */
int cache_entry_check(CacheEntry *entry, Py_ssize_t *failed);

/* call_key_layout(key) (call_key_layout), call_key_bytes(key) -> bytes,
 * shape_guards_match(stored, key, wild, code) -> bool: `key` a CallKey or a stored
 * CacheEntry; the last runs a shape-guard program on two byte strings (tests).
 * Each returns a new reference, NULL with an exception set. */
PyObject *cache_call_key_layout(PyObject *module, PyObject *key);
PyObject *cache_call_key_nested_layout(PyObject *module, PyObject *key);
PyObject *cache_set_key_struct_types(PyObject *module, PyObject *types);
PyObject *cache_call_key_bytes(PyObject *module, PyObject *key);
PyObject *cache_shape_guards_match(PyObject *module, PyObject *args);

/* describe_call_key(key, names=None): see call_key_describe; `key` a CallKey or a
 * stored CacheEntry.  New reference, NULL with an exception set. */
PyObject *cache_describe_call_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames);

/* Module-level read of a module's training flag, normalised to Py_True/Py_False.
 * Borrowed result; NULL with an exception set on error.  May run Python: a
 * `training` property or `__getattr__` on the module's class, `__bool__` of what it
 * returns. */
PyObject *cache_read_training(PyObject *module);

/* cache_flag when the last read cannot be reused: reads the flag
 * (cache_read_training) and remembers it in `r` where it came from the module's
 * own __dict__.  Borrowed result, as cache_read_training's. */
PyObject *cache_flag_read(FlagRead *r, PyObject *module);

/* The training flag of `module` (alive) as Py_True/Py_False, borrowed: the value of
 * its last read `r` while nothing it came from changed (FlagRead), else read again
 * and remembered.  `*clock` is nns_dict_clock() as of now: read before the first
 * flag of a check or call, and read again here after a read that may have run Python
 * (which may have changed the next flag's dict).  Same result and errors as
 * cache_read_training.  Inline: a hit reads one per flag guard and one per flag the
 * graph takes. */
static inline PyObject *
cache_flag(FlagRead *r, PyObject *module, uint64_t *clock)
{
    PyTypeObject *type = Py_TYPE(module);
    /* Same class, not modified since (tags are never reused; 0 is "none"), so a
     * `training` property or __getattribute__ is no more there than it was; the
     * same __dict__, so it is alive and may be read; unchanged since the read. */
    if (type == r->type && r->tag != 0 && type->tp_version_tag == r->tag &&
        nns_object_dict_at(module, r->offset) == r->dict &&
#ifndef NNS_DICT_CLOCK
        nns_dict_version(r->dict) == r->version
#else
        *clock != 0 && *clock == r->version
#endif
        ) {
        return r->value;
    }
    PyObject *flag = cache_flag_read(r, module);
    *clock = nns_dict_clock();
    return flag;
}

#endif
