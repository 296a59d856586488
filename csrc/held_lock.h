/* held_lock.h - a lock held for exactly one call, whatever interrupts it.
 *
 * `with lock:` is not safe against asynchronous exceptions (KeyboardInterrupt from
 * a signal handler) on 3.13+: the periodic check that runs pending signal handlers
 * is part of the CALL instruction that ran `__enter__`, and that instruction lies
 * outside the range the `with` protects.  An interrupt landing there leaves the
 * lock held with no `__exit__` to come, and the next `with lock:` on any thread
 * waits forever (found by tests/test_interrupts.py on 3.14: a first call hung in
 * compile_awareness).  `lock.acquire()` before a `try:` has the same gap, and
 * `try: lock.acquire()` cannot tell in its `finally` whether the acquire happened.
 *
 * Here acquire, call and release are one C call: no bytecode runs between the
 * acquire's return and the call, or between the call's return and the release, so
 * no signal handler can run there.  A handler that raises while the acquire waits
 * makes the acquire fail without the lock (threading's own contract), and then fn
 * is not called.
 */
#ifndef NNSCALER_HELD_LOCK_H
#define NNSCALER_HELD_LOCK_H

#include "compat.h"

/* call_holding(lock, fn, /, *args, **kwargs): lock.acquire(); fn(*args, **kwargs);
 * lock.release(), the release on every exit of fn.  `lock` is anything with
 * acquire() and release() (threading.Lock, RLock).  New reference; NULL with fn's
 * exception (or the acquire's, or the release's when fn succeeded).  Runs Python
 * (fn, and the lock's methods if they are Python). */
PyObject *call_holding(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                       PyObject *kwnames);

#endif /* NNSCALER_HELD_LOCK_H */
