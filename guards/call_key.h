/* call_key.h - guard kind 1: the per-call key.
 *
 * A byte string describing everything about a call that the captured graph was
 * specialised on: grad mode, and for each argument slot its type and, for tensors,
 * dtype, device, shape, strides and requires_grad, or the index of the same tensor
 * met earlier in the key (aliased inputs); objects of the structured classes
 * (call_key_set_struct_types) by type and `__dict__`; for non-tensor values their value
 * (None/bool/int/float/str, recursively through tuples, lists and dicts; torch.Size,
 * named tuples, NumPy scalars and torch.device by value too) or, for any other
 * object, its identity (see pin() in call_key.c).  Hashed with XXH3; a hit compares the stored
 * bytes in full.  The identity of `self` is not in the key: entries are grouped per
 * `self` in a CacheBucket.
 *
 * One encoding, one description: logs and explain() show call_key_describe() of
 * these bytes (call_key_reader.h, the encoding's only decoder), so what they show is
 * what a hit compares.  The bytes are laid out in call_key_format.h.
 */
#ifndef NNSCALER_CALL_KEY_H
#define NNSCALER_CALL_KEY_H

#include "compat_objects.h"

#define CALL_KEY_INLINE 512
#define CALL_KEY_MAX_ALIAS 64   /* tensors tracked for aliasing in one key */
#define CALL_KEY_ALIAS_LINEAR 4 /* up to this many: a linear scan finds an alias */
#define CALL_KEY_ALIAS_SLOTS 128   /* a power of two, at least 2 * CALL_KEY_MAX_ALIAS */
#define CALL_KEY_MAX_STRUCT_TYPES 32
#define CALL_KEY_SHARED_INLINE 16   /* keyed objects tracked without an allocation */

/* CallKey.flags */
#define CALL_KEY_PINS 1         /* collect pins while building: the key will be stored */
#define CALL_KEY_RAN_PYTHON 2   /* code beyond this file's may have run since the build
                                   began (a tensor subclass's getters, a container
                                   snapshot's allocation and so the GC, a guard check in
                                   cache_lookup): the key may no longer describe the
                                   arguments, nor its addresses name live objects */

typedef struct {
    unsigned char *data;        /* points at inline_buf or a PyMem block */
    size_t len, cap;
    PyObject *pins;             /* owned list or NULL: objects keyed by identity */
    int flags;                  /* CALL_KEY_PINS, CALL_KEY_RAN_PYTHON */
    Py_ssize_t n_tensors;       /* tensors put so far */
    /* Structured objects (TAG_STRUCT) and the lists and dicts inside them, put so
     * far: one met again is written as TAG_SHARED and its index (the runner writes
     * into them, so two arguments holding one object differ from two objects). */
    int in_struct;              /* > 0 while putting a structured object's contents */
    Py_ssize_t n_shared, cap_shared;
    void **shared;              /* shared_inline or a PyMem block; addresses only */
    void *shared_inline[CALL_KEY_SHARED_INLINE];
    void *tensors[CALL_KEY_MAX_ALIAS];   /* their addresses (alias detection only) */
    /* Past CALL_KEY_ALIAS_LINEAR tensors, an open-addressing set over `tensors`, by
     * address: the index + 1 of each, 0 for an empty slot.  One probe sequence per
     * tensor finds an alias or the slot the new tensor takes. */
    unsigned char alias_set[CALL_KEY_ALIAS_SLOTS];
    unsigned char inline_buf[CALL_KEY_INLINE];
} CallKey;

/* `flags`: CALL_KEY_PINS for a key that will be stored, else 0. */
void call_key_init(CallKey *key, int flags);
/* Drop the key's buffer and its pins.  May run Python: releasing the last reference
 * to a pinned object runs its finaliser (__del__, weakref callbacks). */
void call_key_release(CallKey *key);

/* Encode `values[0..n)` (borrowed; the caller keeps them alive). 0, or -1
 * with an exception set.  May run Python: tensor attribute getters (tensor
 * subclasses), conversions of int subclasses, the GC on allocating container
 * snapshots; wherever it may, it sets CALL_KEY_RAN_PYTHON.  Containers are walked
 * through owned snapshots, so such code cannot free what the walk holds. */
int call_key_build(CallKey *key, PyObject *const *values, Py_ssize_t n);

/* XXH3 of the key's bytes: what a stored entry keeps as its key_hash.  The hit path
 * compares lengths and bytes instead (a bucket holds a few entries, and a memcmp that
 * stops at the first difference costs less than hashing every byte of every call). */
uint64_t call_key_hash(const CallKey *key);

/* Move `src` (built) into `dst` (initialised, empty; its CALL_KEY_PINS is kept);
 * `src` is left empty. */
void call_key_move(CallKey *dst, CallKey *src);

/* Pin `obj` (borrowed) in `key` as a build with CALL_KEY_PINS does: a weak reference
 * to it, or the object itself where it cannot be weakly referenced, appended to the
 * key's pins (call_key_pin_from_bytes).  0, or -1 with an exception set.  May run
 * Python: the allocation may start the GC. */
int call_key_pin(CallKey *key, PyObject *obj);

/* Key instances of exactly these classes (a tuple; it replaces the last one) by
 * their type and instance __dict__, by value as a dict is, in place of identity
 * (transformers KV caches passed as arguments: a new cache object per generate()
 * call must hit the same entries).  The classes are held.  0, or -1 with a
 * TypeError (not a tuple of at most CALL_KEY_MAX_STRUCT_TYPES classes with a
 * __dict__). */
int call_key_set_struct_types(PyObject *types);

/* nnscaler_eval._C.CallKey: the key of one miss, made by the miss path (dispatch.c)
 * and handed to convert_frame, which describes it; then stored with the entry.
 * CallKey(*values) from Python builds the key of those values (tests, tools). */
typedef struct {
    PyObject_HEAD
    CallKey key;
} CallKeyObject;

extern PyTypeObject CallKey_Type;

/* New reference: an empty CallKey object whose key collects pins.  NULL with an
 * exception set. */
CallKeyObject *call_key_object_new(void);

#endif
