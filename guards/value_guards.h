/* value_guards.h - guards on Python values a capture read (docs/design.md, "Guards",
 * the module tree and hook dicts included: guard_builder.py makes them exact VG_DICTs).
 *
 * A concrete trace sees values, not where they came from: every plain value that
 * shaped the graph (`self.scale`, `Dropout.p`, a global, a closure cell, a default, an
 * item of a list attribute, an attribute of a config object) is recorded by the Python
 * side (nnscaler_eval/guarding/state_guards.py) as one of these guards:
 *
 *   VG_DICT      (0, dict, keys, expected, missing[, owner[, watched]]): the dict's
 *                version is snapshotted;
 *                while it does not move, the guard holds at the cost of one load.  When
 *                it moved, the recorded keys are re-read and compared (`missing` stands
 *                for "absent"); if all still match, the new version is remembered, so an
 *                unrelated write (a counter, `train()`) costs one re-validation, not a
 *                recapture.  Module __dict__s, objects' __dict__s, class dicts, globals.
 *                With `watched` True, the dict must hold exactly `keys` (a key added
 *                fails the re-validation): `_parameters`, plain dicts.
 *                With `watched` (a frozenset of the names captured code can read), a
 *                re-validation also fails when a watched name the dict did not hold
 *                was added (it would shadow a class attribute, say); `keys` then
 *                lists only the watched names it held.
 *                With `owner` (the object whose __dict__ it is), the owner is held
 *                weakly and its __dict__ looked up on each check (the guard holds
 *                neither: a module's __dict__ leads back to the module), and its
 *                class compared by identity (`__class__` assignment moves no dict).
 *   VG_LIST      (1, list, expected): length and items compared on every check (lists
 *                have no version tag).
 *   VG_CELL      (2, cell, expected): a closure cell's content.
 *   VG_FUNCTION  (3, function, code, defaults, kwdefaults): a function object still runs
 *                the same code with the same defaults (identity).
 *   VG_TENSOR    (4, weakref to tensor, dtype, device, shape): metadata of a tensor that
 *                is not an input (a parameter, buffer or constant) and that Python code
 *                read (`x.to(self.weight.dtype)`); `.to()` / `.half()` in place move it.
 *   VG_CALL      (5, callable): a C-level predicate returning True while it holds
 *                (torch's GlobalStateGuard.check: autocast, default dtype, ...).
 *   VG_TENSORS   (6, epoch dict, (weakref, ...), ((dtype, device, shape), ...)): the
 *                metadata of many tensors, re-read only when the epoch dict's version
 *                moved (nnscaler_eval bumps it whenever nn.Module._apply runs: `.to()`,
 *                `.half()`, `.cuda()`); otherwise one load.
 *   VG_BYTES     (7, object): the contents of a mutable buffer no dict version covers
 *                (a bytearray, an array.array, a NumPy array): its layout (item size,
 *                shape, strides, format) and its bytes, snapshotted when the guard is
 *                made and compared with memcmp on every check.  Only for exporters
 *                implemented in C (the Python side picks the types): taking the
 *                buffer then runs no Python.  The object is held strongly.
 *   VG_SLOTS     (8, object, names, expected, missing): attributes kept in `__slots__`
 *                (no dict, so no version): each name must be an object slot (a member
 *                descriptor) of the object's class; the check reads the slots where
 *                they live, runs no Python, and compares with same_value (`missing`
 *                stands for an unset slot).  The object is held strongly, its class
 *                compared by identity.
 *
 * Values are compared by identity, except exact int/float/complex/str/bytes, tuples
 * (elementwise) and torch.device, which compare by value (`self.p = 0.1` written again
 * holds).  A failing comparison or an error while checking counts as "does not hold":
 * the call recaptures; it never hits on doubt.
 *
 * References: a ValueGuard never keeps a module alive through what it compares:
 * expected values that can be weakly referenced (objects, functions, modules) are
 * held by weakref (a dead one never matches again: -1), dicts with an owner are
 * reached through the owner's weakref, tensors are held weakly.  Dicts without an
 * owner (globals, class dicts, plain dict values), lists, cells, functions and
 * expected values that cannot be weakly referenced (ints, strings, tuples, lists)
 * are held strongly.
 */
#ifndef NNSCALER_VALUE_GUARDS_H
#define NNSCALER_VALUE_GUARDS_H

#include "compat_objects.h"

enum {
    VG_DICT = 0,
    VG_LIST = 1,
    VG_CELL = 2,
    VG_FUNCTION = 3,
    VG_TENSOR = 4,
    VG_CALL = 5,
    VG_TENSORS = 6,
    VG_BYTES = 7,
    VG_SLOTS = 8,
};

typedef struct {
    int kind;
    PyObject *target;     /* owned: the dict / list / cell / function / weakref / callable
                             / epoch dict (VG_TENSORS, with `keys` the weakrefs) /
                             buffer exporter (VG_BYTES) / slotted object (VG_SLOTS);
                             VG_DICT with an owner: a weakref to the owner */
    PyObject *keys;       /* owned tuple (VG_DICT) or NULL */
    PyObject *expected;   /* owned tuple: expected values or fields, or NULL (VG_CALL) */
    PyObject *missing;    /* owned (VG_DICT): the object that stands for "absent" */
    PyObject *watched;    /* owned frozenset (VG_DICT) or NULL: names whose addition
                             invalidates */
    int exact;            /* VG_DICT: the dict holds exactly `keys` */
    union {
        PyObject *dict;   /* VG_DICT: the dict (== target, or borrowed from the owner:
                             compared by address only, never dereferenced unchecked) */
        Py_ssize_t *slot_offsets;  /* VG_SLOTS: where each slot lives in the object
                             (PyMem, owned); sharing the field keeps the struct the
                             size the hit path's loop over guards was measured at */
    };
    PyTypeObject *owner_type;  /* owned (VG_DICT with an owner): the owner's class when
                             guarded; `obj.__class__ = Other` moves no dict, and the
                             attributes it read now come from another class */
    Py_ssize_t dict_offset;    /* VG_DICT with an owner: where an instance of
                             owner_type keeps its __dict__ pointer, or 0 (look it up) */
    char *weak;           /* per expected item: 1 when held as a weakref */
    uint64_t version;     /* VG_DICT: version at which `expected` was last validated */
} ValueGuard;

/* Fill `guard` from one spec tuple (see above). 0, or -1 with an exception set
 * (a clear TypeError/ValueError naming what is wrong with the spec). */
int value_guard_init(ValueGuard *guard, PyObject *spec);

/* Release what `guard` owns (safe on a zeroed or partly filled guard).  May run
 * Python: the last reference to an expected value or a VG_CALL callable can go. */
void value_guard_clear(ValueGuard *guard);

int value_guard_traverse(ValueGuard *guard, visitproc visit, void *arg);

/* Expected item `i` (0 <= i < len(expected)), borrowed; NULL when it was held weakly
 * and died.  Runs no Python, never raises. */
PyObject *value_guard_expected(ValueGuard *guard, Py_ssize_t i);

/* 1 when the guard holds, 0 when it does not, -1 when it can never hold again (a
 * weakly held tensor died, or the guard fails and one of its weakly held expected
 * values died: nothing alive can be that object).  Never leaves an exception set.
 * May run Python: tensor-subclass getters,
 * the VG_CALL predicate.  The caller must own a reference to whatever holds `guard`. */
int value_guard_check(ValueGuard *guard);

#endif
