/* cache.h - cache buckets: the entries (cache_entry.h) of one code object for one
 * `self`, most recently used first, and the lookup a hit runs over them.
 *
 * References: a bucket owns its entries and holds `self` weakly; buckets are owned
 * by a GC-visible home (cache_table.h), so cycles through an entry's guards back to
 * the module or the compiled wrapper are collected.
 */
#ifndef NNSCALER_CACHE_H
#define NNSCALER_CACHE_H

#include "cache_entry.h"

typedef struct {
    PyObject_HEAD
    PyObject *self_ref;        /* owned weakref to `self` (with a callback), or NULL */
    void *self_id;             /* identity of `self` (NULL for function targets) */
    int dead;                  /* `self` was collected or reset() retired the bucket:
                                  entries released, never found again */
    PyObject *entries;         /* owned list of CacheEntry, most recently used first */
    PyObject *dropped;         /* owned list of str or NULL: why stale entries were
                                  dropped since the miss path last looked (logs) */
    PyObject *eager_types;     /* owned tuple of (type, reason) pairs, or NULL: a call
                                  with an argument of one of these exact types (at the
                                  top level or inside tuples, lists and dicts) runs
                                  eagerly, its callees intercepted, before any key is
                                  built or entry made (HF KV caches: a new object per
                                  generate(), mutated in place) */
    Py_ssize_t misses, fallbacks, captures, hits;
    int limit_warned;
    PyObject *weakreflist;     /* a CacheTable refers to a bucket a home owns weakly */
} CacheBucket;

extern PyTypeObject CacheBucket_Type;

/* New bucket of `owner` (borrowed: `self`, or the function object of a compiled
 * function), which it holds weakly.  New reference; NULL with an exception set. */
CacheBucket *cache_bucket_new(PyObject *owner);

/* reset(): the bucket is dead from now on; its entries and counters are dropped.
 * Never fails.  May run Python (what the entries release): the caller owns a
 * reference to `bucket`. */
void cache_bucket_retire(CacheBucket *bucket);

/* 1 when one of `args` is (or directly holds, up to a small depth) an object of one
 * of the bucket's eager_types, else 0.  Runs no Python, never raises. */
int cache_bucket_runs_eagerly(CacheBucket *bucket, PyObject *const *args, Py_ssize_t n);

/* Borrowed entry whose key equals `key` and whose guards hold, or NULL.  Stale
 * entries met on the way are removed.  Never raises.  May run Python (value guards):
 * the caller owns a reference to `bucket`; the entry returned is still in its list.
 * When it returns NULL after checking the guards of an entry with this key, it sets
 * CALL_KEY_RAN_PYTHON on `key` (the miss path then builds the key again). */
CacheEntry *cache_lookup(CacheBucket *bucket, CallKey *key);

/* Store `entry` under `key` (a copy of its bytes, and a reference to its pins).  A
 * dead bucket (reset() during the capture) stores nothing.  0 / -1.  May run Python:
 * allocating the stored key and growing the entry list can start the GC. */
int cache_insert(CacheBucket *bucket, CacheEntry *entry, const CallKey *key);

#endif
