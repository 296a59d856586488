/* cache_table.c - CacheTable: owner -> bucket in O(1) (see cache_table.h). */
#include "cache_table.h"

#define TABLE_MIN_CAPACITY 8

static inline size_t
owner_hash(void *owner)
{
    /* Objects are 16-byte aligned: drop the bits that never vary, then mix. */
    uintptr_t h = (uintptr_t)owner >> 4;
    return (size_t)(h * (uintptr_t)0x9E3779B97F4A7C15ULL);
}

/* Borrowed bucket a slot refers to, or NULL when it was collected or retired. */
static inline CacheBucket *
slot_bucket(const CacheTableSlot *slot)
{
    PyObject *ref = slot->ref;
    if (ref == NULL) {
        return NULL;
    }
    if (!Py_IS_TYPE(ref, &CacheBucket_Type)) {
        ref = nns_weakref_object(ref);
        if (ref == Py_None) {
            return NULL;
        }
    }
    CacheBucket *bucket = (CacheBucket *)ref;
    return bucket->dead ? NULL : bucket;
}

/* The slot of `owner`, or the empty slot where it would go.  `capacity` > 0. */
static CacheTableSlot *
probe(CacheTableSlot *slots, Py_ssize_t capacity, void *owner)
{
    size_t mask = (size_t)capacity - 1;
    size_t i = owner_hash(owner) & mask;
    while (slots[i].owner != NULL && slots[i].owner != owner) {
        i = (i + 1) & mask;
    }
    return &slots[i];
}

CacheBucket *
cache_table_find(CacheTable *table, PyObject *owner)
{
    if (table->capacity == 0) {
        return NULL;
    }
    CacheTableSlot *slot = probe(table->slots, table->capacity, owner);
    if (slot->owner == NULL) {
        return NULL;
    }
    CacheBucket *bucket = slot_bucket(slot);
    return (bucket != NULL && bucket->self_id == (void *)owner) ? bucket : NULL;
}

/* Makes room for one more key in an open-addressed slot array (a table's owners or
 * a set's configs): a new array holding only the slots `live` accepts.  Their
 * references move; the old array, with the dead slots' references still in it,
 * goes to *garbage for the caller to release once its structure is consistent
 * again (releasing may run Python).  0, or -1 with MemoryError. */
static int
rehash(CacheTableSlot **slots_p, Py_ssize_t *capacity_p, Py_ssize_t *used_p,
       int (*live)(const CacheTableSlot *), CacheTableSlot **garbage,
       Py_ssize_t *garbage_n)
{
    CacheTableSlot *old = *slots_p;
    Py_ssize_t old_capacity = *capacity_p, n_live = 0;
    for (Py_ssize_t i = 0; i < old_capacity; i++) {
        n_live += live(&old[i]);
    }
    Py_ssize_t capacity = TABLE_MIN_CAPACITY;
    while (capacity < 2 * (n_live + 1)) {
        capacity *= 2;
    }
    CacheTableSlot *slots = PyMem_Calloc((size_t)capacity, sizeof(CacheTableSlot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < old_capacity; i++) {
        if (live(&old[i])) {
            *probe(slots, capacity, old[i].owner) = old[i];
            old[i].ref = NULL;
        }
    }
    *garbage = old;
    *garbage_n = old_capacity;
    *slots_p = slots;
    *capacity_p = capacity;
    *used_p = n_live;
    return 0;
}

static int
bucket_slot_live(const CacheTableSlot *slot)
{
    return slot_bucket(slot) != NULL;
}

static void
release_slots(CacheTableSlot *slots, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(slots[i].ref);
    }
    PyMem_Free(slots);
}

/* Drops the dead buckets from a home list (they were retired or their owner died).
 * Errors are cleared: this is housekeeping. */
static void
prune_home(PyObject *home)
{
    for (Py_ssize_t i = PyList_GET_SIZE(home) - 1; i >= 0; i--) {
        if (i < PyList_GET_SIZE(home) &&
            ((CacheBucket *)PyList_GET_ITEM(home, i))->dead &&
            PySequence_DelItem(home, i) < 0) {
            PyErr_Clear();
            return;
        }
    }
}

CacheBucket *
cache_table_add(CacheTable *table, PyObject *owner, PyObject *home)
{
    CacheBucket *bucket = NULL;        /* owned */
    PyObject *ref = NULL;              /* owned */
    CacheTableSlot *garbage = NULL;    /* PyMem, with owned references */
    Py_ssize_t garbage_n = 0;

    if ((bucket = cache_bucket_new(owner)) == NULL) {
        return NULL;
    }
    if (home != NULL) {
        prune_home(home);   /* may run Python: before the table is touched */
        if (PyList_Append(home, (PyObject *)bucket) < 0 ||
            (ref = PyWeakref_NewRef((PyObject *)bucket, NULL)) == NULL) {
            goto error;
        }
    }
    else {
        ref = Py_NewRef(bucket);
    }
    /* From here to the slot write nothing runs Python: the probe stays valid. */
    if ((table->used + 1) * 3 > table->capacity * 2 &&
        rehash(&table->slots, &table->capacity, &table->used, bucket_slot_live,
               &garbage, &garbage_n) < 0) {
        goto error;
    }
    CacheTableSlot *slot = probe(table->slots, table->capacity, owner);
    PyObject *old = slot->ref;   /* a dead bucket of an earlier owner at this address */
    if (slot->owner == NULL) {
        table->used++;
    }
    slot->owner = owner;
    slot->ref = ref;
    Py_XDECREF(old);
    if (garbage != NULL) {
        release_slots(garbage, garbage_n);
    }
    return bucket;
error:
    Py_XDECREF(ref);
    Py_DECREF(bucket);
    return NULL;
}

PyObject *
cache_table_buckets(CacheTable *table)
{
    PyObject *result = PyList_New(0);
    for (Py_ssize_t i = 0; result != NULL && i < table->capacity; i++) {
        CacheBucket *bucket = slot_bucket(&table->slots[i]);
        if (bucket != NULL && PyList_Append(result, (PyObject *)bucket) < 0) {
            Py_CLEAR(result);
        }
    }
    return result;
}

void
cache_table_retire_all(CacheTable *table)
{
    /* Take the slots first: retiring runs Python (entries released), which may add
     * to this table again; what it adds then is new and stays. */
    CacheTableSlot *slots = table->slots;
    Py_ssize_t capacity = table->capacity;
    table->slots = NULL;
    table->capacity = table->used = 0;
    for (Py_ssize_t i = 0; i < capacity; i++) {
        CacheBucket *bucket = slot_bucket(&slots[i]);
        if (bucket != NULL) {
            Py_INCREF(bucket);
            cache_bucket_retire(bucket);
            Py_DECREF(bucket);
        }
    }
    release_slots(slots, capacity);
}

/* ---------------------------------------------------------------- the type */

static CacheTable *
cache_table_new(PyObject *config)
{
    CacheTable *table = PyObject_GC_New(CacheTable, &CacheTable_Type);
    if (table == NULL) {
        return NULL;
    }
    table->slots = NULL;
    table->capacity = table->used = 0;
    table->config_key = PyWeakref_NewRef(config, NULL);
    if (table->config_key == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyObject_GC_Del(table);
            return NULL;
        }
        PyErr_Clear();   /* not weakly referenceable: keyed by identity, pinned */
        table->config_key = Py_NewRef(config);
    }
    PyObject_GC_Track(table);
    return table;
}

PyObject *
cache_table_config(CacheTable *table)
{
    PyObject *key = table->config_key;
    return PyWeakref_CheckRef(key) ? nns_weakref_object(key) : key;
}

static int
table_traverse(CacheTable *self, visitproc visit, void *arg)
{
    Py_VISIT(self->config_key);
    for (Py_ssize_t i = 0; i < self->capacity; i++) {
        Py_VISIT(self->slots[i].ref);
    }
    return 0;
}

static int
table_clear(CacheTable *self)
{
    CacheTableSlot *slots = self->slots;
    Py_ssize_t capacity = self->capacity;
    self->slots = NULL;
    self->capacity = self->used = 0;
    release_slots(slots, capacity);
    Py_CLEAR(self->config_key);
    return 0;
}

static void
table_dealloc(CacheTable *self)
{
    PyObject_GC_UnTrack(self);
    table_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyTypeObject CacheTable_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.CacheTable",
    .tp_basicsize = sizeof(CacheTable),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The cache buckets of one code object and capture config (internal).",
    .tp_dealloc = (destructor)table_dealloc,
    .tp_traverse = (traverseproc)table_traverse,
    .tp_clear = (inquiry)table_clear,
};

/* ----------------------------------------------------- tables of one code */

/* Borrowed live table a set slot refers to: its config still alive. */
static inline CacheTable *
slot_table(const CacheTableSlot *slot)
{
    CacheTable *table = (CacheTable *)slot->ref;
    return (table != NULL && cache_table_config(table) == (PyObject *)slot->owner)
        ? table : NULL;
}

CacheTable *
cache_tables_find(CacheTableSet *set, PyObject *config)
{
    if (set->capacity == 0) {
        return NULL;
    }
    CacheTableSlot *slot = probe(set->slots, set->capacity, config);
    return slot->owner != NULL ? slot_table(slot) : NULL;
}

static int
table_slot_live(const CacheTableSlot *slot)
{
    return slot_table(slot) != NULL;
}

CacheTable *
cache_tables_ensure(CacheTableSet *set, PyObject *config)
{
    CacheTable *table = cache_tables_find(set, config);
    if (table != NULL) {
        return (CacheTable *)Py_NewRef(table);
    }
    CacheTableSlot *garbage = NULL;
    Py_ssize_t garbage_n = 0;
    if ((table = cache_table_new(config)) == NULL) {
        return NULL;
    }
    /* No Python from here to the slot write. */
    if ((set->used + 1) * 3 > set->capacity * 2 &&
        rehash(&set->slots, &set->capacity, &set->used, table_slot_live,
               &garbage, &garbage_n) < 0) {
        Py_DECREF(table);
        return NULL;
    }
    CacheTableSlot *slot = probe(set->slots, set->capacity, config);
    PyObject *old = slot->ref;   /* the table of a dead config at this address */
    if (slot->owner == NULL) {
        set->used++;
    }
    slot->owner = config;
    slot->ref = Py_NewRef(table);
    Py_XDECREF(old);
    if (garbage != NULL) {
        release_slots(garbage, garbage_n);
    }
    return table;
}

PyObject *
cache_tables_buckets(CacheTableSet *set)
{
    /* Collected first: building the lists allocates, and a collection may run
     * Python that changes the set. */
    PyObject *tables = PyList_New(0);
    for (Py_ssize_t i = 0; tables != NULL && i < set->capacity; i++) {
        CacheTable *table = slot_table(&set->slots[i]);
        if (table != NULL && PyList_Append(tables, (PyObject *)table) < 0) {
            Py_CLEAR(tables);
        }
    }
    PyObject *result = tables != NULL ? PyList_New(0) : NULL;
    for (Py_ssize_t i = 0; result != NULL && i < PyList_GET_SIZE(tables); i++) {
        PyObject *buckets = cache_table_buckets((CacheTable *)PyList_GET_ITEM(tables, i));
        Py_ssize_t end = PyList_GET_SIZE(result);
        if (buckets == NULL || PyList_SetSlice(result, end, end, buckets) < 0) {
            Py_CLEAR(result);
        }
        Py_XDECREF(buckets);
    }
    Py_XDECREF(tables);
    return result;
}

void
cache_tables_retire_all(CacheTableSet *set)
{
    CacheTableSlot *slots = set->slots;
    Py_ssize_t capacity = set->capacity;
    set->slots = NULL;
    set->capacity = set->used = 0;
    for (Py_ssize_t i = 0; i < capacity; i++) {
        if (slots[i].ref != NULL) {
            cache_table_retire_all((CacheTable *)slots[i].ref);   /* held by the slot */
        }
    }
    release_slots(slots, capacity);
}

void
cache_tables_clear(CacheTableSet *set)
{
    CacheTableSlot *slots = set->slots;
    Py_ssize_t capacity = set->capacity;
    set->slots = NULL;
    set->capacity = set->used = 0;
    release_slots(slots, capacity);
}
