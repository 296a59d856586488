/* compiled_call.c - the C callables that nnscaler.compile() installs.
 *
 * ModuleCall: stored as a module's `_compiled_call_impl`, which
 *   nn.Module._wrapped_call_impl calls in place of _call_impl.  It arms this thread
 *   with the module's capture config and, when neither the module nor the global
 *   registries hold hooks, calls `forward` directly (what _call_impl itself does in
 *   that case); otherwise it calls `_call_impl` so the root's hooks run as in eager.
 * CompiledFunction: wraps a plain function; arms the thread with the function's
 *   code as the capture target.
 */
#include "compiled_call.h"
#include "arming.h"
#include "code_state.h"
#include "dispatch.h"
#include "frame_record.h"
#include "nns_globals.h"
#include "tensor_meta.h"
#include "structmember.h"

/* ---------------------------------------------------------------- ModuleCall */

/* The last "no hooks, and forward is the class's plain function" decision, kept
 * while nothing it read has changed: the module's __dict__ (identity and version:
 * an attribute set, a hook dict replaced, an instance `forward`), the four hook dicts
 * found in it (their versions), and the class (its version tag).  On 3.12+ the dict
 * clock vouches for all of them at once while it has not moved (compat.h).  The
 * global hook registries are not in it: their sizes are read on every call. */
enum { N_HOOK_DICTS = 4 };

typedef struct {
    PyObject *dict;                        /* borrowed, compared only; NULL: none kept */
    uint64_t dict_version;
    PyObject *hooks[N_HOOK_DICTS];         /* borrowed: values of `dict` (or NULL), alive
                                            * while its version holds */
    uint64_t hook_versions[N_HOOK_DICTS];
    unsigned int type_tag;                 /* tp_version_tag when decided, never 0 */
    int vouched;                           /* every dict above is watched (3.12+): an
                                            * unmoved clock vouches for them */
    uint64_t clock;                        /* nns_dict_clock() when last found current */
    PyObject *forward;                     /* borrowed from the class, alive under its
                                            * version tag */
} PlainCall;

typedef struct {
    PyObject_HEAD
    PyObject *module_ref;  /* owned weakref to the module, which owns us (its
                              _compiled_call_impl): held weakly so that a compiled
                              module is freed when its last reference goes, as an
                              eager one is, not at the next cyclic collection (its
                              tensors, and a DDP/FSDP wrapper's process group, with
                              it) */
    PyObject *config;      /* owned */
    PyObject *buckets;     /* owned list: the cache buckets made in this module's calls
                              (their home, GC-visible; cache_table.h) */
    vectorcallfunc vectorcall;
    PlainCall plain;
} ModuleCall;

/* 1 when `owner_dict[name]` holds something, 0 when not, -1 on error.  Runs
 * Python only for a non-dict value (its __bool__), with that value held. */
static int
dict_nonempty(PyObject *owner_dict, PyObject *name)
{
    PyObject *d = PyDict_GetItemWithError(owner_dict, name);   /* borrowed */
    if (d == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    if (PyDict_Check(d)) {
        return PyDict_GET_SIZE(d) > 0;
    }
    Py_INCREF(d);
    int r = PyObject_IsTrue(d);
    Py_DECREF(d);
    return r;
}

/* 1 when a global hook registry (torch.nn.modules.module's) holds anything. */
static int
global_hooks_present(void)
{
    PyObject *globals = nns_globals.global_hook_dicts;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(globals); i++) {
        if (PyDict_GET_SIZE(PyTuple_GET_ITEM(globals, i)) > 0) {
            return 1;
        }
    }
    return 0;
}

/* 1 when calling the module must go through _call_impl (hooks present), 0 when
 * not, -1 on error.  May run Python (see dict_nonempty): the module's __dict__ is
 * held while it is read. */
static int
module_has_hooks(PyObject *module)
{
    int result = 1;
    PyObject *dict = NULL;   /* owned */
    if (global_hooks_present()) {
        goto done;
    }
    PyObject *own = nns_object_dict(module);
    if (own == NULL) {
        goto done;
    }
    dict = Py_NewRef(own);
    PyObject *names[] = {nns_globals.str_forward_hooks, nns_globals.str_forward_pre_hooks,
                         nns_globals.str_backward_hooks, nns_globals.str_backward_pre_hooks};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        int r = dict_nonempty(dict, names[i]);
        if (r != 0) {
            result = r;
            goto done;
        }
    }
    result = 0;
done:
    Py_XDECREF(dict);
    return result;
}

/* New reference to the plain function `forward` of `module`'s class when calling
 * module.forward(...) would call exactly it (no instance attribute of that name, no
 * __getattribute__ or descriptor in the way), else NULL.  Runs no Python except a
 * key's __eq__ in the instance dict; NULL with an exception set on error. */
static PyObject *
plain_forward(PyObject *module)
{
    PyTypeObject *tp = Py_TYPE(module);
    if (!nns_type_reads_instance_dict(tp, nns_globals.str_forward)) {
        return NULL;
    }
    PyObject *fn = nns_type_lookup(tp, nns_globals.str_forward);
    if (fn == NULL || !PyFunction_Check(fn)) {
        return NULL;
    }
    Py_INCREF(fn);
    PyObject *dict = nns_object_dict(module);
    if (dict != NULL) {
        Py_INCREF(dict);
        int shadowed = PyDict_Contains(dict, nns_globals.str_forward);
        Py_DECREF(dict);
        if (shadowed != 0) {
            Py_CLEAR(fn);   /* an instance attribute `forward`, or an error */
        }
    }
    return fn;
}

/* Calls `fn(module, *args, **kwnames)` without making a bound method. */
static PyObject *
call_unbound(PyObject *fn, PyObject *module, PyObject *const *args, size_t nargsf,
             PyObject *kwnames)
{
    PyObject *small[9];
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t total = nargs + 1 + (kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject **stack = small;
    if (total > (Py_ssize_t)(sizeof(small) / sizeof(small[0]))) {
        stack = PyMem_Malloc(sizeof(PyObject *) * (size_t)total);
        if (stack == NULL) {
            return PyErr_NoMemory();
        }
    }
    stack[0] = module;
    memcpy(stack + 1, args, sizeof(PyObject *) * (size_t)(total - 1));
    PyObject *result = PyObject_Vectorcall(fn, stack, (size_t)(nargs + 1), kwnames);
    if (stack != small) {
        PyMem_Free(stack);
    }
    return result;
}

/* Borrowed `forward` of the kept decision when it still holds for `module`, else
 * NULL.  Runs no Python, never raises. */
static PyObject *
plain_call_kept(PlainCall *kept, PyObject *module)
{
    if (kept->dict == NULL || global_hooks_present()) {
        return NULL;
    }
    PyObject *dict = nns_object_dict(module);
    if (dict != kept->dict || Py_TYPE(module)->tp_version_tag != kept->type_tag) {
        return NULL;
    }
    uint64_t clock = nns_dict_clock();
    if (kept->vouched && clock == kept->clock) {
        return kept->forward;   /* no watched dict changed since it was found current */
    }
    /* The module dict first: while its version holds, the hook dicts it names are
     * the ones recorded, and alive. */
    if (nns_dict_version(dict) != kept->dict_version) {
        return NULL;
    }
    for (int i = 0; i < N_HOOK_DICTS; i++) {
        if (kept->hooks[i] != NULL &&
            nns_dict_version(kept->hooks[i]) != kept->hook_versions[i]) {
            return NULL;
        }
    }
    kept->clock = clock;
    return kept->forward;
}

/* Keep "no hooks, plain `forward`" for `module`, when every dict it rests on can be
 * versioned (its hook entries are exact dicts); else keep nothing.  Runs no Python. */
static void
plain_call_keep(PlainCall *kept, PyObject *module, PyObject *forward)
{
    kept->dict = NULL;
    PyObject *dict = nns_object_dict(module);
    unsigned int tag = Py_TYPE(module)->tp_version_tag;
    if (dict == NULL || tag == 0 || !PyType_HasFeature(Py_TYPE(module), Py_TPFLAGS_VALID_VERSION_TAG)) {
        return;
    }
    PyObject *names[N_HOOK_DICTS] = {
        nns_globals.str_forward_hooks, nns_globals.str_forward_pre_hooks,
        nns_globals.str_backward_hooks, nns_globals.str_backward_pre_hooks};
    int all_watched = nns_dict_watched(dict);
    for (int i = 0; i < N_HOOK_DICTS; i++) {
        PyObject *hooks = PyDict_GetItemWithError(dict, names[i]);   /* borrowed */
        if (hooks == NULL && PyErr_Occurred()) {
            PyErr_Clear();
            return;
        }
        if (hooks != NULL && !PyDict_Check(hooks)) {
            return;   /* its emptiness is its __bool__: asked on every call */
        }
        kept->hooks[i] = hooks;
        if (hooks != NULL) {
            kept->hook_versions[i] = nns_dict_version(hooks);
            all_watched = all_watched && nns_dict_watched(hooks);
        }
    }
    kept->dict_version = nns_dict_version(dict);
    kept->type_tag = tag;
    kept->forward = forward;
    kept->vouched = all_watched;
    kept->clock = nns_dict_clock();
    kept->dict = dict;
}

/* torch.Tensor and nn.Parameter once read (torch keeps both for good). */
static PyTypeObject *plain_tensor, *plain_parameter;

/* 1 when `arg` is exactly a torch.Tensor or an nn.Parameter. */
static inline int
plain_tensor_arg(PyObject *arg)
{
    if (plain_tensor == NULL && !nns_tensor_classes(&plain_tensor, &plain_parameter)) {
        return 0;
    }
    return Py_IS_TYPE(arg, plain_tensor) || Py_IS_TYPE(arg, plain_parameter);
}

/* Slots of a frameless call held on the C stack; a call with more arguments takes a
 * PyMem block for them (its cost is small against the key's per tensor). */
enum { FRAMELESS_STACK_SLOTS = 64 };

/* `forward(module, *args)` for a plain positional call, answered from the cache
 * without making the forward's frame (dispatch_hit_by_slots), else through the frame
 * as always.  Frameless only where the frame would add nothing: positional arguments
 * filling the parameters exactly (no defaults, *args, **kwargs or keyword-only), each
 * an exact tensor, None or a bool (the key reads them without Python), no capture
 * recording frames on this thread, not inside a trace callback.  The thread is
 * armed with the module's config by the caller.  New reference, NULL on error. */
static PyObject *
call_forward(ModuleCall *self, PyObject *forward, PyObject *module, PyObject *const *args,
             size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyCodeObject *code = (PyCodeObject *)PyFunction_GET_CODE(forward);
    CodeState *cs;
    if (kwnames != NULL || code->co_argcount != nargs + 1 ||
        code->co_kwonlyargcount != 0 || (code->co_flags & (CO_VARARGS | CO_VARKEYWORDS)) ||
        (cs = code_state_peek(code)) == NULL || !(cs->flags & CS_FORWARD) ||
        (cs->flags & CS_SKIP) || frame_record_active() ||
        nns_thread_in_trace_callback(PyThreadState_Get())) {
        return call_unbound(forward, module, args, nargsf, kwnames);
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *arg = args[i];
        if (!plain_tensor_arg(arg) && arg != Py_None && !PyBool_Check(arg)) {
            return call_unbound(forward, module, args, nargsf, kwnames);
        }
    }
    PyObject *stack_slots[FRAMELESS_STACK_SLOTS];
    PyObject **slots = stack_slots;
    if (nargs + 1 > FRAMELESS_STACK_SLOTS &&
        (slots = PyMem_Malloc(sizeof(PyObject *) * (size_t)(nargs + 1))) == NULL) {
        return call_unbound(forward, module, args, nargsf, kwnames);   /* no frameless */
    }
    slots[0] = module;
    memcpy(slots + 1, args, sizeof(PyObject *) * (size_t)nargs);
    PyObject *result;
    int done = dispatch_hit_by_slots(cs, self->config, module, slots, nargs + 1, &result);
    if (slots != stack_slots) {
        PyMem_Free(slots);
    }
    return done ? result : call_unbound(forward, module, args, nargsf, kwnames);
}

/* The module, a new reference; NULL with ReferenceError once it was collected (a
 * wrapper taken out of its module and called later). */
static PyObject *
module_call_module(ModuleCall *self)
{
    PyObject *module = nns_weakref_object(self->module_ref);
    if (module == Py_None) {
        PyErr_SetString(PyExc_ReferenceError,
                        "nnscaler: this compiled call's module was garbage-collected; "
                        "compile the module again (nnscaler.compile(module))");
        return NULL;
    }
    return Py_NewRef(module);
}

/* Reentrancy: the hook check and the attribute read may run Python that deletes
 * this wrapper from the module or the module's other references; the module and
 * the target are held for the whole call, the config and the home by the call
 * region. */
static PyObject *
module_call_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    ModuleCall *self = (ModuleCall *)callable;
    PyObject *result = NULL;
    /* owned */
    PyObject *module = module_call_module(self);
    if (module == NULL) {
        return NULL;
    }
    PyObject *target = NULL;
    ArmSaved saved;

    PyObject *kept = plain_call_kept(&self->plain, module);
    if (kept != NULL) {
        target = Py_NewRef(kept);
        arm_push_home(&saved, self->config, NULL, self->buckets);
        result = call_forward(self, target, module, args, nargsf, kwnames);
        arm_pop(&saved);
        goto done;
    }
    int hooks = module_has_hooks(module);
    if (hooks < 0) {
        goto done;
    }
    if (!hooks) {
        /* What _call_impl does without hooks is call forward: take the function
         * from the class when nothing can intercept the lookup. */
        if ((target = plain_forward(module)) != NULL) {
            plain_call_keep(&self->plain, module, target);
            arm_push_home(&saved, self->config, NULL, self->buckets);
            result = call_forward(self, target, module, args, nargsf, kwnames);
            arm_pop(&saved);
            goto done;
        }
        if (PyErr_Occurred()) {
            goto done;
        }
    }
    target = PyObject_GetAttr(module, hooks ? nns_globals.str_call_impl : nns_globals.str_forward);
    if (target == NULL) {
        goto done;
    }
    arm_push_home(&saved, self->config, NULL, self->buckets);
    result = PyObject_Vectorcall(target, args, nargsf, kwnames);
    arm_pop(&saved);
done:
    Py_XDECREF(target);
    Py_DECREF(module);
    return result;
}

static PyObject *
module_call_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"module", "config", NULL};
    PyObject *module, *config;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:ModuleCall", kwlist, &module, &config)) {
        return NULL;
    }
    ModuleCall *self = (ModuleCall *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->config = Py_NewRef(config);
    if ((self->module_ref = PyWeakref_NewRef(module, NULL)) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->vectorcall = module_call_vectorcall;
    if ((self->buckets = PyList_New(0)) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
module_call_traverse(ModuleCall *self, visitproc visit, void *arg)
{
    Py_VISIT(self->module_ref);
    Py_VISIT(self->config);
    Py_VISIT(self->buckets);
    return 0;
}

static int
module_call_clear(ModuleCall *self)
{
    Py_CLEAR(self->module_ref);
    Py_CLEAR(self->config);
    Py_CLEAR(self->buckets);
    return 0;
}

static void
module_call_dealloc(ModuleCall *self)
{
    PyObject_GC_UnTrack(self);
    module_call_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef module_call_members[] = {
    {"config", T_OBJECT, offsetof(ModuleCall, config), READONLY, "the capture config"},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(ModuleCall, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *
module_call_reduce(ModuleCall *self, PyObject *Py_UNUSED(ignored))
{
    /* copy.deepcopy / pickle of the wrapper itself (not of a compiled module:
     * nn.Module.__getstate__ drops _compiled_call_impl, so a copied module is plain,
     * as with torch.compile).  A copied wrapper wraps the same module, with empty
     * caches: buckets are not copied. */
    PyObject *module = module_call_module(self);
    if (module == NULL) {
        return NULL;
    }
    PyObject *reduced = Py_BuildValue("(O(OO))", Py_TYPE(self), module, self->config);
    Py_DECREF(module);
    return reduced;
}

static PyMethodDef module_call_methods[] = {
    {"__reduce__", (PyCFunction)module_call_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyTypeObject ModuleCall_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.ModuleCall",
    .tp_basicsize = sizeof(ModuleCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "ModuleCall(module, config): a compiled module's _compiled_call_impl.",
    .tp_new = module_call_new,
    .tp_dealloc = (destructor)module_call_dealloc,
    .tp_traverse = (traverseproc)module_call_traverse,
    .tp_clear = (inquiry)module_call_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(ModuleCall, vectorcall),
    .tp_members = module_call_members,
    .tp_methods = module_call_methods,
};

/* ---------------------------------------------------------- CompiledFunction */

typedef struct {
    PyObject_HEAD
    PyObject *fn;          /* owned */
    PyObject *code;        /* owned: fn.__code__ at compile time */
    PyObject *config;      /* owned */
    PyObject *dict;        /* owned: __wrapped__, __name__, ... (functools.wraps) */
    PyObject *buckets;     /* owned list: home of the cache buckets made in its calls */
    vectorcallfunc vectorcall;
} CompiledFunction;

static PyObject *
compiled_function_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames)
{
    CompiledFunction *self = (CompiledFunction *)callable;
    PyObject *fn = Py_NewRef(self->fn);   /* held: the call may clear the wrapper */
    ArmSaved saved;
    arm_push_home(&saved, self->config, self->code, self->buckets);
    PyObject *result = PyObject_Vectorcall(fn, args, nargsf, kwnames);
    arm_pop(&saved);
    Py_DECREF(fn);
    return result;
}

static PyObject *
compiled_function_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fn", "config", NULL};
    PyObject *fn, *config;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:CompiledFunction", kwlist, &fn, &config)) {
        return NULL;
    }
    if (!PyFunction_Check(fn)) {
        PyErr_Format(PyExc_TypeError, "CompiledFunction: expected a Python function, got %.100s",
                     Py_TYPE(fn)->tp_name);
        return NULL;
    }
    CompiledFunction *self = (CompiledFunction *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->fn = Py_NewRef(fn);
    self->code = Py_NewRef(PyFunction_GET_CODE(fn));
    self->config = Py_NewRef(config);
    self->vectorcall = compiled_function_vectorcall;
    if ((self->buckets = PyList_New(0)) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyObject *
compiled_function_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type))
{
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, obj);
}

static int
compiled_function_traverse(CompiledFunction *self, visitproc visit, void *arg)
{
    Py_VISIT(self->fn);
    Py_VISIT(self->code);
    Py_VISIT(self->config);
    Py_VISIT(self->dict);
    Py_VISIT(self->buckets);
    return 0;
}

static int
compiled_function_clear(CompiledFunction *self)
{
    Py_CLEAR(self->fn);
    Py_CLEAR(self->code);
    Py_CLEAR(self->config);
    Py_CLEAR(self->dict);
    Py_CLEAR(self->buckets);
    return 0;
}

static void
compiled_function_dealloc(CompiledFunction *self)
{
    PyObject_GC_UnTrack(self);
    compiled_function_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef compiled_function_members[] = {
    {"config", T_OBJECT, offsetof(CompiledFunction, config), READONLY, "the capture config"},
    {"_nnscaler_fn", T_OBJECT, offsetof(CompiledFunction, fn), READONLY, "the wrapped function"},
    {"__dictoffset__", T_PYSSIZET, offsetof(CompiledFunction, dict), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(CompiledFunction, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef compiled_function_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject CompiledFunction_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnscaler_eval._C.CompiledFunction",
    .tp_basicsize = sizeof(CompiledFunction),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "CompiledFunction(fn, config): a function compiled by nnscaler.compile().",
    .tp_new = compiled_function_new,
    .tp_dealloc = (destructor)compiled_function_dealloc,
    .tp_traverse = (traverseproc)compiled_function_traverse,
    .tp_clear = (inquiry)compiled_function_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(CompiledFunction, vectorcall),
    .tp_descr_get = compiled_function_get,
    .tp_dictoffset = offsetof(CompiledFunction, dict),
    .tp_members = compiled_function_members,
    .tp_getset = compiled_function_getset,
};
