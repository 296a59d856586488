/* hooked_call.h - a hooked submodule's call at hit time (docs/design.md, "Capture").
 *
 * A submodule with hooks is one opaque node of its parent's graph; at a hit the
 * generated runner calls it through call_hooked(module, args, kwargs), which does
 * what nn.Module.__call__ does (torch's _call_impl: forward pre-hooks, forward,
 * forward hooks, always_call hooks on an exception) with the hooks run in a
 * disarmed call region (the evaluator uninstalled unless another thread needs it:
 * plain Python in hooks costs what it costs eagerly) and the forward alone armed
 * again, so it is still served from its own cache.  What it does not reproduce
 * line for line goes to nn.Module.__call__, armed: backward hooks, a class with its
 * own _call_impl or _wrapped_call_impl, a patched nn.Module.__call__, a module
 * compiled on its own, TorchScript tracing.
 */
#ifndef NNSCALER_HOOKED_CALL_H
#define NNSCALER_HOOKED_CALL_H

#include "compat.h"

/* _C.set_hooked_call(registries, wrapped_call_impl, call_impl, get_tracing_state):
 * torch.nn.modules.module (whose _global_* hook dicts are read per call), the
 * functions nn.Module.__call__ and _call_impl are, and torch's tracing-state query.
 * Held for the process.  New reference (None); NULL with a TypeError.  Runs no
 * Python. */
PyObject *hooked_call_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* _C.call_hooked(module, args_tuple, kwargs_dict): as described above.  New
 * reference (what the call returns), NULL with an exception set.  Runs the module's
 * hooks and forward (any Python). */
PyObject *hooked_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
