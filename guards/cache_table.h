/* cache_table.h - the buckets of one (code object, capture config), found by owner.
 *
 * A CodeState (co_extra) keeps one CacheTable per config.  The table maps an owner
 * (`self` for a module forward, the function object of a compiled function) to its
 * CacheBucket in O(1): open addressing on the owner's address, which is safe to
 * compare because a bucket learns of its owner's death through a weakref callback
 * (`dead`) before the address can be reused.
 *
 * Who owns a bucket decides whether the garbage collector can see it:
 *  - a *home* (a PyList owned by the compiled wrapper whose call region created
 *    the bucket: ModuleCall or CompiledFunction, both GC-tracked) owns it, and the
 *    table keeps only a weak reference.  co_extra is not traversed by the GC, so
 *    this is what lets a cycle through an entry (a hook that is a bound method of
 *    the model, a closure cell holding the compiled wrapper) be collected;
 *  - without a home (enable(backend=...) regions) the table owns it, as long as the
 *    config lives.
 *
 * Nothing here runs Python except where a function says so (dropping references).
 */
#ifndef NNSCALER_CACHE_TABLE_H
#define NNSCALER_CACHE_TABLE_H

#include "cache.h"

typedef struct {
    void *owner;       /* identity of the bucket's owner; NULL: an empty slot */
    PyObject *ref;     /* owned: the CacheBucket, or a weakref to it (a home owns it) */
} CacheTableSlot;

typedef struct {
    PyObject_HEAD
    PyObject *config_key;      /* owned: a weakref to the config, or the config itself
                                  when it cannot be weakly referenced (then pinned) */
    CacheTableSlot *slots;     /* PyMem; capacity is a power of two, or 0 */
    Py_ssize_t capacity;
    Py_ssize_t used;           /* slots with an owner, live or not */
} CacheTable;

extern PyTypeObject CacheTable_Type;

/* The tables of one code object, found by config in O(1) (many instances each
 * compiled on its own make many configs for one forward).  Keyed by the config's
 * address, checked against the table's weak reference to it.  Embedded in the
 * CodeState; zero-initialised is empty. */
typedef struct {
    CacheTableSlot *slots;     /* owner: a config's address; ref: owned CacheTable */
    Py_ssize_t capacity;
    Py_ssize_t used;
} CacheTableSet;

/* Borrowed table of `config`, or NULL.  Runs no Python, never raises. */
CacheTable *cache_tables_find(CacheTableSet *set, PyObject *config);
/* New reference to the table of `config`, made if missing (tables of collected
 * configs are dropped when the set grows).  NULL with an exception set on error.
 * May run Python (what dropped tables release). */
CacheTable *cache_tables_ensure(CacheTableSet *set, PyObject *config);
/* New reference: a list of every live bucket of every table.  NULL with an
 * exception set. */
PyObject *cache_tables_buckets(CacheTableSet *set);
/* reset(): the set is emptied and every bucket of its tables retired.  Never
 * fails; may run Python. */
void cache_tables_retire_all(CacheTableSet *set);
/* Frees the set's slots and tables (the code object is being freed).  May run
 * Python. */
void cache_tables_clear(CacheTableSet *set);

/* Borrowed: the table's config, or Py_None once it was collected. */
PyObject *cache_table_config(CacheTable *table);

/* Borrowed live bucket of `owner`, or NULL.  Runs no Python, never raises. */
CacheBucket *cache_table_find(CacheTable *table, PyObject *owner);

/* New bucket for `owner` (borrowed), owned by `home` (a list, borrowed; appended
 * to) or, when `home` is NULL, by the table.  New reference; NULL with an
 * exception set on error.  May run Python (dropping dead buckets' slots). */
CacheBucket *cache_table_add(CacheTable *table, PyObject *owner, PyObject *home);

/* New reference: a list of the table's live buckets.  NULL with an exception set
 * on error. */
PyObject *cache_table_buckets(CacheTable *table);

/* reset(): every bucket of the table is retired (`dead`, its entries and counters
 * dropped), wherever it is owned, and the table forgets them.  Never fails.  May
 * run Python (what the entries release); the caller owns a reference to `table`. */
void cache_table_retire_all(CacheTable *table);

#endif
