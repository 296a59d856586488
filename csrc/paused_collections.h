/* paused_collections.h - one call during which no garbage collection runs.
 *
 * A collection runs Python that is nobody's call: gc callbacks, the finalizers and
 * weakref callbacks of cyclic garbage.  During a capture that Python would run as the
 * forward's own (tracing/asynchronous.py): a finalizer's torch calls recorded into
 * the graph and replayed by every later call, its names guarded.  So the capture runs
 * with collections paused, and they resume after it if they ran before.
 *
 * In Python, `gc.disable()` before a `try:` and `gc.enable()` in its `finally` each
 * leave a gap where a signal handler's KeyboardInterrupt lands outside the `try`, or
 * before the `finally` calls anything: collections then stay off for the rest of the
 * process (found by tests/test_interrupts.py).  Here the pause, the call and the
 * resume are one C call: no bytecode runs between them (held_lock.h, the same gap).
 * An explicit `gc.collect()` inside still collects.
 */
#ifndef NNSCALER_PAUSED_COLLECTIONS_H
#define NNSCALER_PAUSED_COLLECTIONS_H

#include "compat.h"

/* call_without_collections(fn, /, *args, **kwargs): fn(*args, **kwargs) with automatic
 * garbage collection disabled, enabled again after, on every exit, if it was enabled
 * before.  New reference; NULL with fn's exception.  Runs Python (fn). */
PyObject *call_without_collections(PyObject *module, PyObject *const *args,
                                   Py_ssize_t nargs, PyObject *kwnames);

#endif /* NNSCALER_PAUSED_COLLECTIONS_H */
