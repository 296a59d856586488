/* hooked_call.c - a hooked submodule's call at hit time (see hooked_call.h).
 *
 * Mirrors torch.nn.Module._call_impl (torch 2.13) for forward hooks: the hook
 * registries are read through attributes and iterated as snapshots of their
 * items() (OrderedDicts: `prepend=True` reorders them), so every hook, its
 * arguments, its result and the order are eager's. */
#include "hooked_call.h"

#include "arming.h"
#include "compat_objects.h"
#include "nns_globals.h"

static struct {
    PyObject *registries;      /* torch.nn.modules.module */
    PyObject *wrapped;         /* nn.Module._wrapped_call_impl (nn.Module.__call__) */
    PyObject *call_impl;       /* nn.Module._call_impl */
    PyObject *tracing_state;   /* torch._C._get_tracing_state */
} hc_objects;

static PyObject *s_call, *s_wrapped, *s_call_impl, *s_compiled, *s_forward,
    *s_bw, *s_bw_pre, *s_fw, *s_fw_pre, *s_fw_pre_kw, *s_fw_kw, *s_fw_always,
    *s_g_fw, *s_g_fw_pre, *s_g_bw, *s_g_bw_pre, *s_g_fw_kw, *s_g_fw_always;

static int
intern_names(void)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_call, "__call__"}, {&s_wrapped, "_wrapped_call_impl"},
        {&s_call_impl, "_call_impl"}, {&s_compiled, "_compiled_call_impl"},
        {&s_forward, "forward"}, {&s_bw, "_backward_hooks"},
        {&s_bw_pre, "_backward_pre_hooks"}, {&s_fw, "_forward_hooks"},
        {&s_fw_pre, "_forward_pre_hooks"}, {&s_fw_pre_kw, "_forward_pre_hooks_with_kwargs"},
        {&s_fw_kw, "_forward_hooks_with_kwargs"}, {&s_fw_always, "_forward_hooks_always_called"},
        {&s_g_fw, "_global_forward_hooks"}, {&s_g_fw_pre, "_global_forward_pre_hooks"},
        {&s_g_bw, "_global_backward_hooks"}, {&s_g_bw_pre, "_global_backward_pre_hooks"},
        {&s_g_fw_kw, "_global_forward_hooks_with_kwargs"},
        {&s_g_fw_always, "_global_forward_hooks_always_called"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].slot == NULL &&
            (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) {
            return -1;
        }
    }
    return 0;
}

PyObject *
hooked_call_setup(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyModule_Check(args[0]) || !PyFunction_Check(args[1]) ||
        !PyFunction_Check(args[2]) || !PyCallable_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "set_hooked_call(registries module, _wrapped_call_impl, _call_impl, "
                        "get_tracing_state)");
        return NULL;
    }
    if (intern_names() < 0) {
        return NULL;
    }
    Py_XSETREF(hc_objects.registries, Py_NewRef(args[0]));
    Py_XSETREF(hc_objects.wrapped, Py_NewRef(args[1]));
    Py_XSETREF(hc_objects.call_impl, Py_NewRef(args[2]));
    Py_XSETREF(hc_objects.tracing_state, Py_NewRef(args[3]));
    Py_RETURN_NONE;
}

/* New reference to obj.name, or to None when it has no such attribute (an older
 * torch without one of the registries); NULL with any other error. */
static PyObject *
attr_or_none(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        value = Py_NewRef(Py_None);
    }
    return value;
}

/* bool(obj.name): 1, 0, or -1 with an exception set. */
static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *value = attr_or_none(obj, name);
    if (value == NULL) {
        return -1;
    }
    int r = PyObject_IsTrue(value);
    Py_DECREF(value);
    return r;
}

/* `key in container` with None as empty: 1, 0, or -1. */
static int
member(PyObject *container, PyObject *key)
{
    return container == Py_None ? 0 : PySequence_Contains(container, key);
}

/* 1: the split call reproduces nn.Module.__call__ for `module` now; 0: call
 * nn.Module.__call__ itself; -1 with an exception set. */
static int
splits(PyObject *module)
{
    PyTypeObject *tp = Py_TYPE(module);
    if (nns_type_lookup(nns_globals.module_type, s_call) != hc_objects.wrapped ||
        nns_type_lookup(tp, s_wrapped) != hc_objects.wrapped ||
        nns_type_lookup(tp, s_call_impl) != hc_objects.call_impl) {
        return 0;
    }
    struct { PyObject *owner; PyObject *name; } none_of[] = {
        {module, s_bw}, {module, s_bw_pre}, {module, s_compiled},
        {hc_objects.registries, s_g_bw}, {hc_objects.registries, s_g_bw_pre},
    };
    for (size_t i = 0; i < sizeof(none_of) / sizeof(none_of[0]); i++) {
        int r = attr_true(none_of[i].owner, none_of[i].name);
        if (r != 0) {
            return r < 0 ? -1 : 0;
        }
    }
    PyObject *state = PyObject_CallNoArgs(hc_objects.tracing_state);
    if (state == NULL) {
        return -1;
    }
    int traced = state != Py_None;
    Py_DECREF(state);
    return !traced;
}

/* nn.Module.__call__(module, *args, **kwargs), as it is now. */
static PyObject *
call_module_plain(PyObject *module, PyObject *args, PyObject *kwargs)
{
    PyObject *call = nns_type_lookup(nns_globals.module_type, s_call);
    if (call == NULL) {
        PyErr_SetString(PyExc_TypeError, "nn.Module has no __call__");
        return NULL;
    }
    Py_INCREF(call);
    PyObject *result = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *full = PyTuple_New(n + 1);
    if (full != NULL) {
        PyTuple_SET_ITEM(full, 0, Py_NewRef(module));
        for (Py_ssize_t i = 0; i < n; i++) {
            PyTuple_SET_ITEM(full, i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
        }
        result = PyObject_Call(call, full, kwargs);
        Py_DECREF(full);
    }
    Py_DECREF(call);
    return result;
}

/* One call's state, as _call_impl's locals: args and kwargs as the pre-hooks left
 * them, the result so far, the always_call hooks run; all owned. */
typedef struct {
    PyObject *module;   /* borrowed: the caller's argument */
    PyObject *args;
    PyObject *kwargs;
    PyObject *result;
    PyObject *called;   /* set, made on first use, or NULL */
} HookCall;

/* 1 when `registry` is None or an empty dict (most calls: nothing to read). */
static int
empty(PyObject *registry)
{
    return registry == Py_None || (PyDict_Check(registry) && PyDict_GET_SIZE(registry) == 0);
}

/* New list of the (key, hook) pairs of `first` then `second` (None: empty). */
static PyObject *
items_of(PyObject *first, PyObject *second)
{
    PyObject *all = PyList_New(0);
    PyObject *parts[] = {first, second};
    for (int i = 0; all != NULL && i < 2; i++) {
        if (empty(parts[i])) {
            continue;
        }
        PyObject *items = PyMapping_Items(parts[i]);
        if (items == NULL) {
            Py_CLEAR(all);
            break;
        }
        PyObject *joined = PySequence_InPlaceConcat(all, items);
        Py_DECREF(items);
        Py_SETREF(all, joined);
    }
    return all;
}

/* The i-th (key, hook) pair of `items`, or -1 with TypeError.  Borrowed from the
 * snapshot, a list only the caller holds: a hook cannot drop them. */
static int
pair_at(PyObject *items, Py_ssize_t i, PyObject **key, PyObject **hook)
{
    PyObject *pair = PyList_GET_ITEM(items, i);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_SetString(PyExc_TypeError, "a hook registry's items() is not (key, hook) pairs");
        return -1;
    }
    *key = PyTuple_GET_ITEM(pair, 0);
    *hook = PyTuple_GET_ITEM(pair, 1);
    return 0;
}

static int
run_pre_hooks(HookCall *c)
{
    int rc = -1;
    PyObject *global = NULL, *own = NULL, *with_kwargs = NULL, *items = NULL;
    if ((global = attr_or_none(hc_objects.registries, s_g_fw_pre)) == NULL ||
        (own = attr_or_none(c->module, s_fw_pre)) == NULL) {
        goto done;
    }
    if (empty(global) && empty(own)) {
        rc = 0;
        goto done;
    }
    if ((with_kwargs = attr_or_none(c->module, s_fw_pre_kw)) == NULL ||
        (items = items_of(global, own)) == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *key, *hook;
        if (pair_at(items, i, &key, &hook) < 0) {
            goto done;
        }
        int kw = member(with_kwargs, key);
        PyObject *r = kw < 0 ? NULL
                      : kw ? PyObject_CallFunctionObjArgs(hook, c->module, c->args, c->kwargs, NULL)
                           : PyObject_CallFunctionObjArgs(hook, c->module, c->args, NULL);
        if (r == NULL) {
            goto done;
        }
        if (r == Py_None) {
            Py_DECREF(r);
        }
        else if (kw) {
            if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
                PyErr_Format(PyExc_RuntimeError,
                             "forward pre-hook must return None or a tuple of "
                             "(new_args, new_kwargs), but got %S.", r);
                Py_DECREF(r);
                goto done;
            }
            Py_SETREF(c->args, Py_NewRef(PyTuple_GET_ITEM(r, 0)));
            Py_SETREF(c->kwargs, Py_NewRef(PyTuple_GET_ITEM(r, 1)));
            Py_DECREF(r);
        }
        else if (PyTuple_Check(r)) {
            Py_SETREF(c->args, r);
        }
        else {
            PyObject *packed = PyTuple_Pack(1, r);
            Py_DECREF(r);
            if (packed == NULL) {
                goto done;
            }
            Py_SETREF(c->args, packed);
        }
    }
    rc = 0;
done:
    Py_XDECREF(global);
    Py_XDECREF(own);
    Py_XDECREF(with_kwargs);
    Py_XDECREF(items);
    return rc;
}

/* result = forward(*args, **kwargs), armed again as the runner was. */
static int
run_forward(HookCall *c, PyObject *forward)
{
    PyObject *args = PySequence_Tuple(c->args);
    if (args == NULL) {
        return -1;
    }
    PyObject *kwargs = NULL;
    if (PyDict_Check(c->kwargs)) {
        kwargs = Py_NewRef(c->kwargs);
    }
    else if ((kwargs = PyDict_New()) != NULL && PyDict_Merge(kwargs, c->kwargs, 1) < 0) {
        Py_CLEAR(kwargs);
    }
    PyObject *result = NULL;
    if (kwargs != NULL) {
        ArmSaved resumed;
        int pushed = arm_push_resumed(&resumed);
        result = PyObject_Call(forward, args, kwargs);
        if (pushed) {
            arm_pop(&resumed);
        }
    }
    Py_DECREF(args);
    Py_XDECREF(kwargs);
    if (result == NULL) {
        return -1;
    }
    Py_SETREF(c->result, result);
    return 0;
}

/* Registries of forward hooks: the global one and the module's, each with its
 * with_kwargs and always_called companions (new references, or NULLs and -1). */
typedef struct {
    PyObject *hooks[2], *with_kwargs[2], *always[2];
} ForwardHooks;

static void
forward_hooks_clear(ForwardHooks *f)
{
    for (int i = 0; i < 2; i++) {
        Py_CLEAR(f->hooks[i]);
        Py_CLEAR(f->with_kwargs[i]);
        Py_CLEAR(f->always[i]);
    }
}

/* 0 with every field read, 1 when both registries are empty (the companions are
 * then not read: None), -1 with an exception set. */
static int
forward_hooks_read(ForwardHooks *f, PyObject *module)
{
    memset(f, 0, sizeof(*f));
    PyObject *owners[2] = {hc_objects.registries, module};
    PyObject *names[2][3] = {{s_g_fw, s_g_fw_kw, s_g_fw_always}, {s_fw, s_fw_kw, s_fw_always}};
    for (int i = 0; i < 2; i++) {
        if ((f->hooks[i] = attr_or_none(owners[i], names[i][0])) == NULL) {
            forward_hooks_clear(f);
            return -1;
        }
    }
    if (empty(f->hooks[0]) && empty(f->hooks[1])) {
        for (int i = 0; i < 2; i++) {
            f->with_kwargs[i] = Py_NewRef(Py_None);
            f->always[i] = Py_NewRef(Py_None);
        }
        return 1;
    }
    for (int i = 0; i < 2; i++) {
        if ((f->with_kwargs[i] = attr_or_none(owners[i], names[i][1])) == NULL ||
            (f->always[i] = attr_or_none(owners[i], names[i][2])) == NULL) {
            forward_hooks_clear(f);
            return -1;
        }
    }
    return 0;
}

/* 1 when `key` is in either registry's companion `which` (0: with_kwargs,
 * 1: always_called), 0 when not, -1 on error. */
static int
in_either(ForwardHooks *f, int which, PyObject *key)
{
    for (int i = 0; i < 2; i++) {
        int r = member(which ? f->always[i] : f->with_kwargs[i], key);
        if (r != 0) {
            return r;
        }
    }
    return 0;
}

static int
run_forward_hooks(HookCall *c)
{
    ForwardHooks f;
    int read = forward_hooks_read(&f, c->module);
    if (read != 0) {
        if (read > 0) {
            forward_hooks_clear(&f);
        }
        return read > 0 ? 0 : -1;
    }
    int rc = -1;
    PyObject *items = items_of(f.hooks[0], f.hooks[1]);
    if (items == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *key, *hook;
        if (pair_at(items, i, &key, &hook) < 0) {
            goto done;
        }
        int always = in_either(&f, 1, key);
        if (always < 0) {
            goto done;
        }
        if (always) {
            if (c->called == NULL && (c->called = PySet_New(NULL)) == NULL) {
                goto done;
            }
            if (PySet_Add(c->called, key) < 0) {
                goto done;
            }
        }
        int kw = in_either(&f, 0, key);
        if (kw < 0) {
            goto done;
        }
        PyObject *r = kw ? PyObject_CallFunctionObjArgs(hook, c->module, c->args, c->kwargs,
                                                        c->result, NULL)
                         : PyObject_CallFunctionObjArgs(hook, c->module, c->args, c->result, NULL);
        if (r == NULL) {
            goto done;
        }
        if (r != Py_None) {
            Py_SETREF(c->result, r);
        }
        else {
            Py_DECREF(r);
        }
    }
    rc = 0;
done:
    Py_XDECREF(items);
    forward_hooks_clear(&f);
    return rc;
}

/* The forward or a hook raised an Exception (set): the always_call hooks that have
 * not run run now, global ones first, each one's own Exception silenced with a
 * warning, as _call_impl does; then the first exception is set again.  A warning
 * turned into an error, or a BaseException from a hook, replaces it. */
static void
run_always_called(HookCall *c)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    ForwardHooks f;
    if (forward_hooks_read(&f, c->module) < 0) {
        goto replaced;
    }
    static const char *what[2] = {"global module forward hook", "module forward hook"};
    for (int i = 0; i < 2; i++) {
        PyObject *items = empty(f.hooks[i]) ? PyList_New(0) : PyMapping_Items(f.hooks[i]);
        if (items == NULL) {
            forward_hooks_clear(&f);
            goto replaced;
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(items); j++) {
            PyObject *key, *hook;
            int always, done_already, kw = 0;
            if (pair_at(items, j, &key, &hook) < 0 ||
                (always = member(f.always[i], key)) < 0 ||
                (done_already = c->called ? PySet_Contains(c->called, key) : 0) < 0 ||
                (i == 1 && (kw = member(f.with_kwargs[i], key)) < 0)) {
                Py_DECREF(items);
                forward_hooks_clear(&f);
                goto replaced;
            }
            if (!always || done_already) {
                continue;
            }
            PyObject *r = kw ? PyObject_CallFunctionObjArgs(hook, c->module, c->args, c->kwargs,
                                                            c->result, NULL)
                             : PyObject_CallFunctionObjArgs(hook, c->module, c->args, c->result,
                                                            NULL);
            if (r != NULL) {
                if (r != Py_None) {
                    Py_SETREF(c->result, r);
                }
                else {
                    Py_DECREF(r);
                }
                continue;
            }
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                Py_DECREF(items);
                forward_hooks_clear(&f);
                goto replaced;
            }
            PyObject *et, *ev, *etb;
            PyErr_Fetch(&et, &ev, &etb);
            PyErr_NormalizeException(&et, &ev, &etb);
            PyObject *text = ev != NULL ? PyObject_Str(ev) : NULL;
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(etb);
            int warned = text == NULL ? -1
                         : PyErr_WarnFormat(PyExc_UserWarning, 1,
                                            "%s with ``always_call=True`` raised an exception "
                                            "that was silenced as another error was raised in "
                                            "forward: %U", what[i], text);
            Py_XDECREF(text);
            if (warned < 0) {
                Py_DECREF(items);
                forward_hooks_clear(&f);
                goto replaced;
            }
        }
        Py_DECREF(items);
    }
    forward_hooks_clear(&f);
    PyErr_Restore(type, value, tb);
    return;
replaced:
    /* a new exception is set: it is what propagates */
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

PyObject *
hooked_call(PyObject *Py_UNUSED(self), PyObject *const *argv, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_Check(argv[1]) || !PyDict_Check(argv[2])) {
        PyErr_SetString(PyExc_TypeError, "call_hooked(module, args tuple, kwargs dict)");
        return NULL;
    }
    if (hc_objects.registries == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "nnscaler_eval._C.set_hooked_call() has not run");
        return NULL;
    }
    PyObject *module = argv[0];
    int split = splits(module);
    if (split <= 0) {
        return split < 0 ? NULL : call_module_plain(module, argv[1], argv[2]);
    }
    PyObject *forward = PyObject_GetAttr(module, s_forward);
    if (forward == NULL) {
        return NULL;
    }
    Py_INCREF(module);   /* a hook may drop the runner's reference */
    HookCall c = {module, Py_NewRef(argv[1]), Py_NewRef(argv[2]), Py_NewRef(Py_None), NULL};
    ArmSaved disarmed;
    arm_push_disarmed(&disarmed);
    PyObject *out = NULL;
    if (run_pre_hooks(&c) == 0 && run_forward(&c, forward) == 0 && run_forward_hooks(&c) == 0) {
        out = Py_NewRef(c.result);
    }
    else if (PyErr_ExceptionMatches(PyExc_Exception)) {
        run_always_called(&c);
    }
    arm_pop(&disarmed);
    Py_DECREF(forward);
    Py_DECREF(c.args);
    Py_DECREF(c.kwargs);
    Py_DECREF(c.result);
    Py_XDECREF(c.called);
    Py_DECREF(module);
    return out;
}
