/* recursion.h - compiled calls get the recursion budget eager calls get.
 *
 * A capture puts this project's own Python frames between the user's: per nested
 * first call, convert_frame, the tracer and the module-call patch sit between a
 * forward and the forward it calls.  Eager code at the same sys.getrecursionlimit()
 * has none of them, so without accounting a model that nests or recurses deeply
 * raises RecursionError under nnscaler.compile where eager does not.
 *
 * The accounting is per thread and in C: the Python side reads the depth of the
 * frame where the user's code handed over to ours (recursion_depth()), and hands
 * back through call_at_depth(depth, fn, ...), which moves only this thread's
 * counter (PyThreadState, compat.h) by the units our frames took in between, for
 * the duration of that one call.  The limit itself is never changed, so no other
 * thread sees anything, and every credit is undone by the same C call that made it
 * (LIFO on the C stack), on every exit: return, exception or KeyboardInterrupt
 * (nothing can run between the credit and the call, or between the return and the
 * debit).
 *
 * The counter also guards the C stack (3.11 has no other guard), and frames run
 * under a PEP 523 evaluator are not inlined (each costs a C-level call of the
 * evaluator).  So credit is given only while the stack left holds every unit the
 * limit still allows at the bytes per unit this thread has used so far (twice,
 * plus a margin), and an armed thread whose stack is down to STACK_FLOOR meets
 * RecursionError in call_at_depth, which every nested call of a capture passes
 * through, rather than a stack overflow further in.
 */
#ifndef NNSCALER_RECURSION_H
#define NNSCALER_RECURSION_H

#include "compat.h"

/* recursion_depth() -> int: the units of the recursion limit in use at the calling
 * Python frame (that frame counted, this call not).  New reference; raises only
 * when the int cannot be allocated. */
PyObject *recursion_depth(PyObject *module, PyObject *noargs);

/* call_at_depth(depth, fn, /, *args, **kwargs): fn(*args, **kwargs), run as if
 * called from a frame at `depth` (fn's own frame then reads depth + 1): the units in
 * use above `depth` right now are credited for the call's duration.  Only ever
 * gives: no credit when fewer units than `depth` are in use, when the difference is
 * implausibly large for our own frames (a stale depth), when the C stack could not
 * hold what the limit would then allow, or when `depth` is None.  RecursionError,
 * without calling, when the thread is armed and its C stack nearly exhausted.  New
 * reference, NULL with an exception (fn's, unchanged).  Runs Python (fn). */
PyObject *call_at_depth(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames);

/* call_with_mode_replaced(mode, stand_in, fn, /, *args, **kwargs): fn(*args,
 * **kwargs) with the torch function mode `mode` replaced by `stand_in` for the call
 * when `mode` is the innermost one (stand_in not pushed again when it is then on top
 * already); a plain call otherwise.  For a trace that is suspended (an opaque module
 * runs for real) or fell back: its mode only passes ops through, and with a trace
 * nested in every opaque call, each op of the innermost trace would otherwise go
 * through one pass-through frame per enclosing trace (depth, and time, growing with
 * the nesting); one shared stand-in doing the same pass-through keeps it at one.
 * No bytecode runs between the swap and the call or between the return and the swap
 * back, so no interrupt can leave the stack swapped.  New reference, NULL with fn's
 * exception (or, if `mode` could not be put back, that error).  Runs Python (fn). */
PyObject *call_with_mode_replaced(PyObject *module, PyObject *const *args,
                                  Py_ssize_t nargs, PyObject *kwnames);

/* _stack_room() -> (free, size): bytes of C stack left below this point on this
 * thread, and the thread's stack size; (-1, -1) where unknown.  For tests.  New
 * reference, NULL with an exception set. */
PyObject *recursion_stack_room(PyObject *module, PyObject *noargs);

#endif
