/* cache_entry.c - CacheEntry: one captured graph and its guards.  First what a hit
 * runs, cache_entry_check and the flag reads, top to bottom; then making and freeing
 * an entry; then what Python sees of it.  The buckets holding entries, and the
 * lookup that calls the check, are cache.c's. */
#include <stddef.h>
#include "cache_entry.h"
#include "call_key_reader.h"
#include "guard_env.h"
#include "structmember.h"

/* ------------------------------------------------- the check: what a hit runs */

#ifdef NNS_DICT_TAGS_MONOTONIC
/* Adds the version at which VG_DICT `guard` last held to the sum of its kind: dicts
 * held directly, or reached through an owner. */
static inline void
add_validated_version(const ValueGuard *guard, nns_tag_sum *held, nns_tag_sum *owned)
{
    nns_tag_sum_add(guard->owner_type != NULL ? owned : held, guard->version);
}

/* 1 when the VG_DICT `guard` holds as it last did, by its version: its owner (if
 * any) lives, has its class and still has the dict as its __dict__ (what
 * guarded_dict looks at, in loads), and the dict is at the guard's version.  0 when
 * that is not certain: value_guard_check then decides, as it always did.  Runs no
 * Python, never raises. */
static inline int
dict_guard_unmoved(const ValueGuard *guard)
{
    if (guard->target != guard->dict) {
        PyObject *owner = nns_weakref_object(guard->target);   /* None when dead */
        if (Py_TYPE(owner) != guard->owner_type ||
            nns_object_dict_at(owner, guard->dict_offset) != guard->dict) {
            return 0;
        }
    }
    return nns_dict_version(guard->dict) == guard->version;
}

/* 1 when every VG_DICT guard of `entry` holds as it last did, from two sums of
 * version tags (compat_objects.h, NNS_DICT_TAGS_MONOTONIC): first the dicts held
 * directly, a load and an add each; equal, none of them changed since their guards
 * held, so the owners they hold are alive and the same (OwnerCheck.held).  Then for
 * each dict reached through its owner what no version shows (the owner lives, has
 * its class, still has that dict as its __dict__: then the dict is alive and may be
 * read), and its version.  0 when not all may hold: the caller checks each guard as
 * before, which finds which one and why (and re-validates a dict that moved).  Runs
 * no Python, never raises. */
static inline int
dicts_unchanged_311(const CacheEntry *entry)
{
    /* The dicts held directly (alive: their guards own them), unrolled by four. */
    nns_tag_sum sum = {0, 0};
    PyObject *const *tagged = entry->tagged;
    const Py_ssize_t n = entry->n_tagged;
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        nns_tag_sum_add(&sum, nns_dict_version(tagged[i]));
        nns_tag_sum_add(&sum, nns_dict_version(tagged[i + 1]));
        nns_tag_sum_add(&sum, nns_dict_version(tagged[i + 2]));
        nns_tag_sum_add(&sum, nns_dict_version(tagged[i + 3]));
    }
    for (; i < n; i++) {
        nns_tag_sum_add(&sum, nns_dict_version(tagged[i]));
    }
    if (!nns_tag_sum_equal(sum, entry->tag_sum_held)) {
        return 0;
    }
    nns_tag_sum owned = {0, 0};
    const OwnerCheck *o = entry->owners;
    const OwnerCheck *const held_end = o + entry->n_held_owners;
    for (; o < held_end; o++) {
        if (Py_TYPE(o->held) != o->type || nns_object_dict_at(o->held, o->offset) != o->dict) {
            return 0;
        }
        nns_tag_sum_add(&owned, nns_dict_version(o->dict));
    }
    for (const OwnerCheck *const end = entry->owners + entry->n_owners; o < end; o++) {
        /* A dead owner reads as None, whose class is not the owner's (NoneType has
         * no instance __dict__ to guard): the class test covers it. */
        PyObject *owner = nns_weakref_object(o->ref);
        if (Py_TYPE(owner) != o->type || nns_object_dict_at(owner, o->offset) != o->dict) {
            return 0;
        }
        nns_tag_sum_add(&owned, nns_dict_version(o->dict));
    }
    return nns_tag_sum_equal(owned, entry->tag_sum_owned);
}
#endif

/* cache_read_training, and in *from_dict the instance __dict__ the flag was found
 * in (borrowed), or NULL when it came from elsewhere (a property, getattr). */
static PyObject *
read_training(PyObject *module, PyObject **from_dict)
{
    *from_dict = NULL;
    /* The common case, no Python: `training` is a bool in the instance __dict__ and
     * nothing on the type (a property, a __getattribute__) comes before it. */
    if (nns_type_reads_instance_dict(Py_TYPE(module), guard_env.str_training)) {
        PyObject *dict = nns_object_dict(module);
        PyObject *flag = dict != NULL && PyDict_CheckExact(dict)
            ? PyDict_GetItemWithError(dict, guard_env.str_training) : NULL;
        if (flag == Py_True || flag == Py_False) {
            *from_dict = dict;
            return flag;
        }
        if (flag == NULL && PyErr_Occurred()) {
            return NULL;
        }
    }
    PyObject *flag = PyObject_GetAttr(module, guard_env.str_training);
    if (flag == NULL) {
        return NULL;
    }
    int truth = (flag == Py_True) ? 1 : (flag == Py_False) ? 0 : PyObject_IsTrue(flag);
    Py_DECREF(flag);
    if (truth < 0) {
        return NULL;
    }
    return truth ? Py_True : Py_False;
}

PyObject *
cache_read_training(PyObject *module)
{
    PyObject *from_dict;
    return read_training(module, &from_dict);
}

PyObject *
cache_flag_read(FlagRead *r, PyObject *module)
{
    PyTypeObject *type = Py_TYPE(module);
    r->tag = 0;
    /* A `training` property may run Python that drops the module: held across. */
    Py_INCREF(module);
    PyObject *from_dict;
    PyObject *flag = read_training(module, &from_dict);
    /* From its own __dict__ (then no Python ran), under a class with a version tag. */
    if (flag != NULL && from_dict != NULL && type->tp_version_tag != 0) {
#ifndef NNS_DICT_CLOCK
        const uint64_t version = nns_dict_version(from_dict);
        const int watched = 1;
#else
        /* Watching a dict moves the clock: the clock after it is the one that stays
         * while this dict (and every other watched one) is unchanged. */
        const int watched = nns_dict_watched(from_dict);
        const uint64_t version = nns_dict_clock();
#endif
        if (watched) {
            *r = (FlagRead){type, type->tp_version_tag, nns_object_dict_offset(module),
                            from_dict, version, flag};
        }
    }
    Py_DECREF(module);
    return flag;
}

int
cache_entry_check(CacheEntry *entry, Py_ssize_t *failed)
{
    /* Read before any check (3.12+; 0 on 3.11): what the dicts are compared with. */
    const uint64_t clock = nns_dict_clock();
    uint64_t flag_clock = clock;   /* moves with Python run by a flag's read */
    for (Py_ssize_t i = 0; i < entry->n_flags; i++) {
        PyObject *module = nns_weakref_object(entry->flag_refs[i]);
        if (module == Py_None) {
            *failed = i;
            return -1;
        }
        PyObject *flag = cache_flag(&entry->flag_guard_reads[i], module, &flag_clock);
        if (flag == NULL) {
            PyErr_Clear();
            *failed = i;
            return 0;
        }
        if ((flag == Py_True) != (entry->flag_values[i] != 0)) {
            *failed = i;
            return 0;
        }
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(entry->training_refs); i++) {
        if (nns_weakref_object(PyTuple_GET_ITEM(entry->training_refs, i)) == Py_None) {
            *failed = -1;
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < entry->n_weak_pins; i++) {
        if (nns_weakref_object(entry->weak_pins[i]) == Py_None) {
            /* an object the key names by address died: the address may be reused */
            *failed = -1;
            return -1;
        }
    }
    Py_ssize_t base = entry->n_flags;
#ifdef NNS_DICT_TAGS_MONOTONIC
    /* 3.11: every dict guard at once; then what no dict version covers (lists,
     * cells, functions, tensors, global state), in their order. */
    if (dicts_unchanged_311(entry)) {
        for (Py_ssize_t k = 0; k < entry->n_unclocked; k++) {
            const Py_ssize_t i = entry->unclocked[k];
            int ok = value_guard_check(&entry->values[i]);
            if (ok != 1) {
                *failed = base + i;
                return ok;
            }
        }
        return 1;
    }
    /* A dict moved (or an owner changed): every guard in its order, as before, a dict
     * still at its guard's version held inline; the sum of the versions they hold at
     * is the next one to compare with (a guard's version only grows). */
    nns_tag_sum held = {0, 0}, owned = {0, 0};
    for (Py_ssize_t i = 0; i < entry->n_values; i++) {
        ValueGuard *guard = &entry->values[i];
        if (guard->kind != VG_DICT || !dict_guard_unmoved(guard)) {
            int ok = value_guard_check(guard);
            if (ok != 1) {
                *failed = base + i;
                return ok;
            }
        }
        if (guard->kind == VG_DICT) {
            add_validated_version(guard, &held, &owned);
        }
    }
    entry->tag_sum_held = held;
    entry->tag_sum_owned = owned;
    return 1;
#else
    /* No watched dict changed since every dict of this entry was last seen
     * unchanged, nor while the flags were read (a `training` property's Python may
     * have replaced a child module, which the owner checks below would then read
     * through a pointer to freed memory): the plain VG_DICT guards hold as they
     * did. */
    const int dicts_unchanged = clock != 0 && entry->clean_clock == clock &&
                                flag_clock == clock;
    /* With the clock unchanged only what it cannot vouch for is looked at: for a dict
     * reached through its owner, that the owner lives, has its class and still has
     * that dict as its __dict__ (CPython tells nothing of `obj.__class__ = ...` or
     * `obj.__dict__ = ...`: the floor of a sound check, a few loads per owner); then
     * lists, cells, functions, tensors and global state. */
    if (dicts_unchanged) {
        /* Owners a held dict holds: alive while it is unchanged, as the clock says. */
        const OwnerCheck *o = entry->owners;
        for (const OwnerCheck *const end = o + entry->n_held_owners; o < end; o++) {
            if (Py_TYPE(o->held) != o->type ||
                nns_object_dict_at(o->held, o->offset) != o->dict) {
                *failed = base + o->index;
                return 0;
            }
        }
        for (Py_ssize_t k = entry->n_held_owners; k < entry->n_owners; k++) {
            o = &entry->owners[k];
            PyObject *owner = nns_weakref_object(o->ref);
            if (owner == Py_None) {
                *failed = base + o->index;
                return -1;
            }
            if (Py_TYPE(owner) != o->type || nns_object_dict_at(owner, o->offset) != o->dict) {
                *failed = base + o->index;
                return 0;
            }
        }
    }
    const Py_ssize_t n = dicts_unchanged ? entry->n_unclocked : entry->n_values;
    for (Py_ssize_t k = 0; k < n; k++) {
        const Py_ssize_t i = dicts_unchanged ? entry->unclocked[k] : k;
        ValueGuard *guard = &entry->values[i];
        if (guard->kind == VG_DICT && guard->target == guard->dict &&
            nns_dict_version(guard->dict) == guard->version) {
            continue;   /* the common case, inline: a dict held directly, unchanged */
        }
        int ok = value_guard_check(guard);
        if (ok != 1) {
            *failed = base + i;
            return ok;
        }
    }
    /* Every check held at `clock` (read before any of them: Python run by a value
     * guard that changes a dict moves the clock past it, and the next check is full). */
    entry->clean_clock = clock;
    return 1;
#endif
}

/* --------------------------------------------------- making and freeing one */

static int
entry_traverse(CacheEntry *self, visitproc visit, void *arg)
{
    Py_VISIT(self->runner);
    Py_VISIT(self->training_refs);
    for (Py_ssize_t i = 0; i < self->n_flags; i++) {
        Py_VISIT(self->flag_refs[i]);
    }
    for (Py_ssize_t i = 0; i < self->n_values; i++) {
        int err = value_guard_traverse(&self->values[i], visit, arg);
        if (err) {
            return err;
        }
    }
    Py_VISIT(self->guard_names);
    Py_VISIT(self->info);
    Py_VISIT(self->pins);
    return 0;
}

static int
entry_clear(CacheEntry *self)
{
    Py_CLEAR(self->runner);
    Py_CLEAR(self->training_refs);
    for (Py_ssize_t i = 0; i < self->n_flags; i++) {
        Py_CLEAR(self->flag_refs[i]);
    }
    for (Py_ssize_t i = 0; i < self->n_values; i++) {
        value_guard_clear(&self->values[i]);
    }
    Py_CLEAR(self->guard_names);
    Py_CLEAR(self->info);
    self->n_weak_pins = 0;   /* borrowed from pins */
    Py_CLEAR(self->pins);
    self->n_owners = self->n_held_owners = 0;   /* borrowed from the guards */
#ifdef NNS_DICT_TAGS_MONOTONIC
    self->n_tagged = 0;   /* the guards released their dicts */
#endif
    return 0;
}

static void
entry_dealloc(CacheEntry *self)
{
    PyObject_GC_UnTrack(self);
    entry_clear(self);
    PyMem_Free(self->flag_refs);
    PyMem_Free(self->flag_values);
    PyMem_Free(self->flag_guard_reads);
    PyMem_Free(self->values);
    PyMem_Free(self->unclocked);
    PyMem_Free(self->owners);
    PyMem_Free(self->flag_reads);
    PyMem_Free(self->weak_pins);
#ifdef NNS_DICT_TAGS_MONOTONIC
    PyMem_Free(self->tagged);
#endif
    PyMem_Free(self->key);
    shape_guards_free(self->shapes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
weakref_tuple(PyObject *modules, const char *what)
{
    PyObject *seq = PySequence_Fast(modules, what);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *refs = PyTuple_New(n);
    for (Py_ssize_t i = 0; refs != NULL && i < n; i++) {
        PyObject *ref = PyWeakref_NewRef(PySequence_Fast_GET_ITEM(seq, i), NULL);
        if (ref == NULL) {
            Py_CLEAR(refs);
            break;
        }
        PyTuple_SET_ITEM(refs, i, ref);
    }
    Py_DECREF(seq);
    return refs;
}

PyDoc_STRVAR(entry_doc,
"CacheEntry(runner, training_modules, flag_guards, guard_names, info, value_guards=())\n\n"
"One captured graph and its guards.  `runner` is called as runner(*slots, *flags)\n"
"on a hit (None: run the frame eagerly).  `training_modules` give the flags passed\n"
"to the runner.  `flag_guards` are (module, bool) pairs compared by value.\n"
"`value_guards` are spec tuples (guards/value_guards.h) on the state the capture\n"
"read, the module tree and hook dicts among them.  `guard_names` describe the\n"
"guards: flag, then value guards.");

#ifdef NNS_DICT_TAGS_MONOTONIC
/* The sums of the versions at which the VG_DICT guards of `entry` last held: what
 * dicts_unchanged_311 compares with.  Any sums of versions each guard once held at
 * would do (an equal sum then means every dict is at that version, so at the
 * guard's own, which lies between it and the dict's); these are exact. */
static void
set_validated_tag_sums(CacheEntry *entry)
{
    nns_tag_sum held = {0, 0}, owned = {0, 0};
    for (Py_ssize_t i = 0; i < entry->n_values; i++) {
        if (entry->values[i].kind == VG_DICT) {
            add_validated_version(&entry->values[i], &held, &owned);
        }
    }
    entry->tag_sum_held = held;
    entry->tag_sum_owned = owned;
}
#endif

static int
compare_addresses(const void *a, const void *b)
{
    const uintptr_t x = (uintptr_t)*(PyObject *const *)a, y = (uintptr_t)*(PyObject *const *)b;
    return (x > y) - (x < y);
}

/* Sets OwnerCheck.held for every owner that a VG_DICT guard of `self` on a dict it
 * holds directly expects as one of its values (a child module in its parent's
 * `_modules`), and moves those owners to the front (n_held_owners).  The root module
 * of a capture, held by nothing the entry guards, keeps its weakref.  0, or -1 with
 * MemoryError set. */
static int
find_held_owners(CacheEntry *self)
{
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < self->n_values; i++) {
        const ValueGuard *guard = &self->values[i];
        if (guard->kind == VG_DICT && guard->target == guard->dict) {
            n += PyTuple_GET_SIZE(guard->expected);
        }
    }
    if (n == 0 || self->n_owners == 0) {
        return 0;
    }
    PyObject **values = PyMem_Malloc((size_t)n * sizeof(PyObject *));
    OwnerCheck *rest = PyMem_Malloc((size_t)self->n_owners * sizeof(OwnerCheck));
    if (values == NULL || rest == NULL) {
        PyMem_Free(values);
        PyMem_Free(rest);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < self->n_values; i++) {
        ValueGuard *guard = &self->values[i];
        if (guard->kind == VG_DICT && guard->target == guard->dict) {
            for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(guard->expected); k++) {
                PyObject *value = value_guard_expected(guard, k);
                if (value != NULL && value != guard->missing) {
                    values[m++] = value;
                }
            }
        }
    }
    qsort(values, (size_t)m, sizeof(PyObject *), compare_addresses);
    /* stable partition: held owners first, each part in guard order */
    Py_ssize_t n_held = 0, n_rest = 0;
    for (Py_ssize_t k = 0; k < self->n_owners; k++) {
        OwnerCheck o = self->owners[k];
        PyObject *owner = nns_weakref_object(o.ref);
        o.held = owner != Py_None &&
                 bsearch(&owner, values, (size_t)m, sizeof(PyObject *), compare_addresses) != NULL
                 ? owner : NULL;
        if (o.held != NULL) {
            self->owners[n_held++] = o;
        }
        else {
            rest[n_rest++] = o;
        }
    }
    memcpy(self->owners + n_held, rest, (size_t)n_rest * sizeof(OwnerCheck));
    self->n_held_owners = n_held;
    PyMem_Free(values);
    PyMem_Free(rest);
    return 0;
}

static PyObject *
entry_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"runner", "training_modules", "flag_guards", "guard_names",
                             "info", "value_guards", NULL};
    PyObject *runner, *training_modules, *flag_guards, *guard_names, *info;
    PyObject *value_guards = NULL;
    PyObject *flags_seq = NULL, *values_seq = NULL;   /* owned */
    CacheEntry *self = NULL;                          /* owned */

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO|O:CacheEntry", kwlist, &runner,
                                     &training_modules, &flag_guards, &guard_names, &info,
                                     &value_guards)) {
        return NULL;
    }
    if (runner != Py_None && !PyCallable_Check(runner)) {
        PyErr_Format(PyExc_TypeError, "CacheEntry: runner must be callable or None, not %.100s",
                     Py_TYPE(runner)->tp_name);
        return NULL;
    }
    self = (CacheEntry *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->runner = runner == Py_None ? NULL : Py_NewRef(runner);
    self->info = Py_NewRef(info);
    if ((self->training_refs = weakref_tuple(training_modules, "training_modules must be a sequence")) == NULL) {
        goto error;
    }
    self->flag_reads = PyMem_Calloc((size_t)PyTuple_GET_SIZE(self->training_refs) + 1,
                                    sizeof(FlagRead));
    if (self->flag_reads == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    if ((flags_seq = PySequence_Fast(flag_guards, "flag_guards must be a sequence")) == NULL) {
        goto error;
    }
    values_seq = value_guards == NULL ? PyTuple_New(0)
                                      : PySequence_Fast(value_guards, "value_guards must be a sequence");
    if (values_seq == NULL) {
        goto error;
    }
    Py_ssize_t nf = PySequence_Fast_GET_SIZE(flags_seq);
    Py_ssize_t nv = PySequence_Fast_GET_SIZE(values_seq);
    self->flag_refs = PyMem_Calloc((size_t)nf + 1, sizeof(PyObject *));
    self->flag_values = PyMem_Calloc((size_t)nf + 1, 1);
    self->flag_guard_reads = PyMem_Calloc((size_t)nf + 1, sizeof(FlagRead));
    self->values = PyMem_Calloc((size_t)nv + 1, sizeof(ValueGuard));
    if (!self->flag_refs || !self->flag_values ||
        !self->flag_guard_reads || !self->values) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < nf; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(flags_seq, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "CacheEntry: flag_guards[%zd] must be (module, bool)", i);
            goto error;
        }
        int value = PyObject_IsTrue(PyTuple_GET_ITEM(pair, 1));
        if (value < 0) {
            goto error;
        }
        PyObject *ref = PyWeakref_NewRef(PyTuple_GET_ITEM(pair, 0), NULL);
        if (ref == NULL) {
            goto error;
        }
        self->flag_refs[i] = ref;
        self->flag_values[i] = (char)value;
        self->n_flags = i + 1;
    }
    for (Py_ssize_t i = 0; i < nv; i++) {
        /* n_values counts the guards filled (a failed init leaves its slot clear) */
        if (value_guard_init(&self->values[i], PySequence_Fast_GET_ITEM(values_seq, i)) < 0) {
            value_guard_clear(&self->values[i]);
            goto error;
        }
        self->n_values = i + 1;
    }
    if (nv > 0 && ((self->unclocked = PyMem_Calloc(nv, sizeof(Py_ssize_t))) == NULL ||
                   (self->owners = PyMem_Calloc(nv, sizeof(OwnerCheck))) == NULL)) {
        PyErr_NoMemory();
        goto error;
    }
#ifdef NNS_DICT_TAGS_MONOTONIC
    if (nv > 0 && (self->tagged = PyMem_Calloc(nv, sizeof(PyObject *))) == NULL) {
        PyErr_NoMemory();
        goto error;
    }
#endif
    for (Py_ssize_t i = 0; i < nv; i++) {
        ValueGuard *guard = &self->values[i];
        if (guard->kind == VG_DICT && guard->owner_type != NULL) {
            self->owners[self->n_owners++] = (OwnerCheck){
                NULL, guard->target, guard->owner_type, guard->dict, guard->dict_offset, i};
        }
        else if (guard->kind == VG_DICT && guard->target == guard->dict) {
#ifdef NNS_DICT_TAGS_MONOTONIC
            self->tagged[self->n_tagged++] = guard->dict;
#endif
        }
        else {
            self->unclocked[self->n_unclocked++] = i;
        }
    }
    if (find_held_owners(self) < 0) {
        goto error;
    }
#ifdef NNS_DICT_TAGS_MONOTONIC
    set_validated_tag_sums(self);
#endif
    if ((self->guard_names = PySequence_Tuple(guard_names)) == NULL) {
        goto error;
    }
    if (PyTuple_GET_SIZE(self->guard_names) != nf + nv) {
        PyErr_Format(PyExc_ValueError, "CacheEntry: %zd guard_names for %zd guards",
                     PyTuple_GET_SIZE(self->guard_names), nf + nv);
        goto error;
    }
    Py_DECREF(flags_seq);
    Py_DECREF(values_seq);
    return (PyObject *)self;
error:
    Py_XDECREF(flags_seq);
    Py_XDECREF(values_seq);
    Py_XDECREF(self);
    return NULL;
}

/* ------------------------------------------------------- what Python sees */

PyDoc_STRVAR(check_verbose_doc,
"check_verbose() -> None or str\n\nNone when every state guard holds, else the name of\n"
"the first failing one (for logs; the hit path uses the C check).");

static PyObject *
entry_check_verbose(CacheEntry *self, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t failed = -1;
    int ok = cache_entry_check(self, &failed);
    if (ok == 1) {
        Py_RETURN_NONE;
    }
    if (failed < 0 || failed >= PyTuple_GET_SIZE(self->guard_names)) {
        return PyUnicode_FromString("a module whose training flag feeds the graph was collected");
    }
    return Py_NewRef(PyTuple_GET_ITEM(self->guard_names, failed));
}

static PyObject *
entry_get_runner(CacheEntry *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->runner ? self->runner : Py_None);
}

static PyObject *
entry_get_key_hash(CacheEntry *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(self->key_hash);
}

static PyObject *
entry_get_n_guards(CacheEntry *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->n_flags + self->n_values);
}

static PyObject *
entry_get_n_held_owners(CacheEntry *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->n_held_owners);
}

static PyObject *
entry_describe_key(CacheEntry *self, PyObject *names)
{
    if (self->key == NULL) {
        PyErr_SetString(PyExc_ValueError, "nnscaler: this CacheEntry has not been stored: no key");
        return NULL;
    }
    return call_key_describe(self->key, self->key_len, self->pins, names);
}

static PyObject *
entry_get_key_description(CacheEntry *self, void *Py_UNUSED(closure))
{
    return entry_describe_key(self, NULL);
}

PyObject *
cache_describe_call_key(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames)
{
    static const char usage[] = "describe_call_key(key, names=None)";
    PyObject *key = NULL, *names = Py_None;
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw < 1 || nargs + nkw > 2 || nargs < 1) {
        PyErr_Format(PyExc_TypeError, "%s takes 1 or 2 arguments", usage);
        return NULL;
    }
    key = args[0];
    if (nargs == 2) {
        names = args[1];
    }
    else if (nkw == 1) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(kwnames, 0)) ||
            PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "names") != 0) {
            PyErr_Format(PyExc_TypeError, "%s: unexpected keyword argument", usage);
            return NULL;
        }
        names = args[1];
    }
    PyObject *tuple = NULL;   /* owned */
    if (names != Py_None) {
        if ((tuple = PySequence_Tuple(names)) == NULL) {
            return NULL;
        }
    }
    PyObject *result = NULL;
    if (PyObject_TypeCheck(key, &CacheEntry_Type)) {
        result = entry_describe_key((CacheEntry *)key, tuple);
    }
    else if (PyObject_TypeCheck(key, &CallKey_Type)) {
        CallKey *k = &((CallKeyObject *)key)->key;
        result = call_key_describe(k->data, k->len, k->pins, tuple);
    }
    else {
        PyErr_Format(PyExc_TypeError, "%s: key must be a CallKey or a CacheEntry, not %.100s",
                     usage, Py_TYPE(key)->tp_name);
    }
    Py_XDECREF(tuple);
    return result;
}

/* set_shape_guards(wild, code, key_len): before the entry is stored. */
static PyObject *
entry_set_shape_guards(CacheEntry *self, PyObject *args)
{
    PyObject *wild, *code;
    Py_ssize_t key_len;
    if (!PyArg_ParseTuple(args, "OOn:set_shape_guards", &wild, &code, &key_len)) {
        return NULL;
    }
    if (self->key != NULL || self->shapes != NULL) {
        PyErr_SetString(PyExc_ValueError,
                        "set_shape_guards: the entry is stored, or has shape guards already");
        return NULL;
    }
    if (key_len < 0) {
        PyErr_SetString(PyExc_ValueError, "set_shape_guards: negative key length");
        return NULL;
    }
    ShapeGuards *shapes = shape_guards_new(wild, code, (size_t)key_len);
    if (shapes == NULL) {
        return NULL;
    }
    /* Reading the ints ran Python (__index__), which may have stored the entry or
     * given it guards meanwhile: checked again, nothing overwritten. */
    if (self->key != NULL || self->shapes != NULL) {
        shape_guards_free(shapes);
        PyErr_SetString(PyExc_ValueError,
                        "set_shape_guards: the entry is stored, or has shape guards already");
        return NULL;
    }
    self->shapes = shapes;
    Py_RETURN_NONE;
}

static PyObject *
int64_tuple(const int64_t *v, Py_ssize_t n)
{
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t != NULL && i < n; i++) {
        PyObject *x = PyLong_FromLongLong((long long)v[i]);
        if (x == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

static PyObject *
entry_get_shape_guards(CacheEntry *self, void *Py_UNUSED(closure))
{
    if (self->shapes == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *wild = int64_tuple(self->shapes->wild, self->shapes->n_wild);
    PyObject *code = int64_tuple(self->shapes->code, self->shapes->n_code);
    PyObject *r = (wild && code) ? PyTuple_Pack(2, wild, code) : NULL;
    Py_XDECREF(wild);
    Py_XDECREF(code);
    return r;
}

static int
key_bytes_of(PyObject *key, const unsigned char **data, size_t *len, const char *usage)
{
    if (PyObject_TypeCheck(key, &CacheEntry_Type)) {
        CacheEntry *e = (CacheEntry *)key;
        if (e->key == NULL) {
            PyErr_Format(PyExc_ValueError, "%s: the entry is not stored yet", usage);
            return -1;
        }
        *data = e->key;
        *len = e->key_len;
        return 0;
    }
    if (PyObject_TypeCheck(key, &CallKey_Type)) {
        CallKey *k = &((CallKeyObject *)key)->key;
        *data = k->data;
        *len = k->len;
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "%s: key must be a CallKey or a CacheEntry, not %.100s",
                 usage, Py_TYPE(key)->tp_name);
    return -1;
}

PyObject *
cache_call_key_layout(PyObject *Py_UNUSED(module), PyObject *key)
{
    const unsigned char *data;
    size_t len;
    if (key_bytes_of(key, &data, &len, "call_key_layout") < 0) {
        return NULL;
    }
    return call_key_layout(data, len);
}

PyObject *
cache_call_key_nested_layout(PyObject *Py_UNUSED(module), PyObject *key)
{
    const unsigned char *data;
    size_t len;
    if (key_bytes_of(key, &data, &len, "call_key_nested_layout") < 0) {
        return NULL;
    }
    return call_key_nested_layout(data, len);
}

PyObject *
cache_set_key_struct_types(PyObject *Py_UNUSED(module), PyObject *types)
{
    return call_key_set_struct_types(types) < 0 ? NULL : Py_NewRef(Py_None);
}

PyObject *
cache_call_key_bytes(PyObject *Py_UNUSED(module), PyObject *key)
{
    const unsigned char *data;
    size_t len;
    if (key_bytes_of(key, &data, &len, "call_key_bytes") < 0) {
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)len);
}

PyObject *
cache_shape_guards_match(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer stored, key;
    PyObject *wild, *code;
    if (!PyArg_ParseTuple(args, "y*y*OO:shape_guards_match", &stored, &key, &wild, &code)) {
        return NULL;
    }
    PyObject *result = NULL;
    ShapeGuards *g = shape_guards_new(wild, code, (size_t)stored.len);
    if (g != NULL) {
        result = PyBool_FromLong(shape_guards_match(g, stored.buf, key.buf, (size_t)key.len));
        shape_guards_free(g);
    }
    PyBuffer_Release(&stored);
    PyBuffer_Release(&key);
    return result;
}

static PyMethodDef entry_methods[] = {
    {"check_verbose", (PyCFunction)entry_check_verbose, METH_NOARGS, check_verbose_doc},
    {"set_shape_guards", (PyCFunction)entry_set_shape_guards, METH_VARARGS,
     "set_shape_guards(wild, code, key_len): make this (not yet stored) entry dynamic:\n"
     "keys match it when equal outside the 8-byte fields at offsets `wild` and the\n"
     "program `code` holds on them (shape_guards.h)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef entry_members[] = {
    {"info", T_OBJECT, offsetof(CacheEntry, info), READONLY, "Python-side description"},
    {"hits", T_PYSSIZET, offsetof(CacheEntry, hits), READONLY, "calls served"},
    {"guard_names", T_OBJECT, offsetof(CacheEntry, guard_names), READONLY, "state guards"},
    {"clean_clock", T_ULONGLONG, offsetof(CacheEntry, clean_clock), READONLY,
     "dict_clock() when every dict was last seen unchanged (0: never; always 0 on 3.11)"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef entry_getset[] = {
    {"runner", (getter)entry_get_runner, NULL, "the callable run on a hit, or None", NULL},
    {"key_hash", (getter)entry_get_key_hash, NULL, "XXH3 hash of the call key", NULL},
    {"n_state_guards", (getter)entry_get_n_guards, NULL, "number of state guards", NULL},
    {"n_held_owners", (getter)entry_get_n_held_owners, NULL,
     "owners of guarded __dict__s that a dict the entry guards holds (read without "
     "their weakrefs while it is unchanged)", NULL},
    {"shape_guards", (getter)entry_get_shape_guards, NULL,
     "(wild, code) of a dynamic entry, or None", NULL},
    {"key_description", (getter)entry_get_key_description, NULL,
     "the stored call key in words (describe_call_key(entry))", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject CacheEntry_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.CacheEntry",
    .tp_basicsize = sizeof(CacheEntry),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = entry_doc,
    .tp_new = entry_new,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_traverse = (traverseproc)entry_traverse,
    .tp_clear = (inquiry)entry_clear,
    .tp_methods = entry_methods,
    .tp_members = entry_members,
    .tp_getset = entry_getset,
};
