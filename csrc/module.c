/* module.c - nnscaler_eval._C: module init and the Python-visible functions.
 *
 * The module is initialised in multi-phase form (PEP 489) but refuses a second
 * interpreter: the PEP 523 hook reaches its state through nns_globals. */
#include "bytecode.h"
#include "capture_code.h"
#include "cache.h"
#include "cache_table.h"
#include "code_state.h"
#include "frame_record.h"
#include "held_lock.h"
#include "paused_collections.h"
#include "hooked_call.h"
#include "compat.h"
#include "arming.h"
#include "compiled_call.h"
#include "eval_frame.h"
#include "graph_replay.h"
#include "nns_globals.h"
#include "recursion.h"
#include "rewrite.h"

/* ------------------------------------------------------------------ arming */

PyDoc_STRVAR(arm_doc,
"arm(config, target=None, home=None) -> token\n\nArm the current context on this thread:\n"
"`config` is the rewrite-mode object, a capture config, or None (disarm, as disable()\n"
"does).  `target` is a code object captured even when it is not a module forward.\n"
"`home` is a list that owns the cache buckets made in the region (the GC sees them\n"
"there; without one the code objects' tables own them).  Returns a token for\n"
"disarm(), to be used on this thread, in this context, innermost first.");

static PyObject *
py_arm(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "arm(config, target=None, home=None)");
        return NULL;
    }
    PyObject *target = nargs >= 2 && args[1] != Py_None ? args[1] : NULL;
    PyObject *home = nargs == 3 && args[2] != Py_None ? args[2] : NULL;
    if (target != NULL && !PyCode_Check(target)) {
        PyErr_Format(PyExc_TypeError, "arm(): target must be a code object, not %.100s",
                     Py_TYPE(target)->tp_name);
        return NULL;
    }
    if (home != NULL && !PyList_CheckExact(home)) {
        PyErr_Format(PyExc_TypeError, "arm(): home must be a list, not %.100s",
                     Py_TYPE(home)->tp_name);
        return NULL;
    }
    if (nns_globals.ifexpr == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "nnscaler_eval._C.install() has not run");
        return NULL;
    }
    return arm_context(args[0], target, home);
}

PyDoc_STRVAR(call_disarmed_doc,
"call_disarmed(fn, /, *args, **kwargs)\n\n"
"fn(*args, **kwargs) with nothing armed on this thread and the evaluator uninstalled\n"
"meanwhile unless another thread needs it: plain Python run here (a module's hooks)\n"
"pays nothing of ours.");

static PyObject *
py_call_disarmed(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargsf,
                 PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "call_disarmed(fn, /, *args, **kwargs): fn missing");
        return NULL;
    }
    ArmSaved saved;
    arm_push_disarmed(&saved);
    PyObject *result = PyObject_Vectorcall(args[0], args + 1, (size_t)(nargs - 1), kwnames);
    arm_pop(&saved);
    return result;
}

PyDoc_STRVAR(disarm_doc, "disarm(token)\n\nClose the region the matching arm() opened.");

static PyObject *
py_disarm(PyObject *Py_UNUSED(module), PyObject *token)
{
    if (disarm_context(token) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ install */

static int
set_global(PyObject **slot, PyObject *value)
{
    Py_XSETREF(*slot, Py_NewRef(value));
    return 0;
}

PyDoc_STRVAR(install_doc,
"install(ifexpr, convert_frame, rewrite_mode, run_eagerly, run_disarmed, module_type,\n"
"        tensor_type, is_grad_enabled, global_hook_dicts, internal_prefix,\n"
"        len_torch_function_stack, pop_torch_function_stack)\n\nHand the C core the Python objects it\n"
"needs (nnscaler_eval does this once at import).");

static PyObject *
py_install(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "install() takes 12 arguments");
        return NULL;
    }
    if (!PyCallable_Check(args[10]) || !PyCallable_Check(args[11])) {
        PyErr_SetString(PyExc_TypeError, "install(): the torch function-mode stack "
                                         "length and pop functions must be callable");
        return NULL;
    }
    if (!PyType_Check(args[5]) || !PyType_Check(args[6]) || !PyTuple_Check(args[8]) ||
        !PyUnicode_Check(args[9])) {
        PyErr_SetString(PyExc_TypeError, "install(): module_type/tensor_type must be types, "
                                         "global_hook_dicts a tuple, internal_prefix a str");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[8]); i++) {
        if (!PyDict_Check(PyTuple_GET_ITEM(args[8], i))) {
            PyErr_SetString(PyExc_TypeError, "install(): global_hook_dicts must hold dicts");
            return NULL;
        }
    }
    set_global(&nns_globals.ifexpr, args[0]);
    set_global(&nns_globals.convert_frame, args[1]);
    set_global(&nns_globals.rewrite_mode, args[2]);
    set_global(&nns_globals.run_eagerly, args[3]);
    set_global(&nns_globals.run_disarmed, args[4]);
    set_global((PyObject **)&nns_globals.module_type, args[5]);
    set_global((PyObject **)&guard_env.tensor_type, args[6]);
    set_global(&guard_env.is_grad_enabled, args[7]);
    set_global(&nns_globals.global_hook_dicts, args[8]);
    set_global(&nns_globals.internal_prefix, args[9]);
    set_global(&nns_globals.len_torch_function_stack, args[10]);
    set_global(&nns_globals.pop_torch_function_stack, args[11]);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------- introspection */

PyDoc_STRVAR(rewrite_code_doc,
"rewrite_code(code, ifexpr) -> (code, n_sites)\n\n"
"Rewrite the `self.training` conditional expressions of `code` into calls of\n"
"`ifexpr`; returns the new code object (or `code` itself) and the site count.");

static PyObject *
rewrite_code(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyCode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "rewrite_code(code, ifexpr): code must be a code object");
        return NULL;
    }
    int n_sites = 0;
    PyObject *code = rewrite_training_ifexpr((PyCodeObject *)args[0], args[1], &n_sites);
    if (code == NULL) {
        return NULL;
    }
    return Py_BuildValue("(Ni)", code, n_sites);
}

PyDoc_STRVAR(code_state_doc,
"code_state(code) -> dict or None\n\nWhat the evaluator decided for `code` (None if it\n"
"has not seen it): skip, forward, n_sites, rewritten, buckets.");

PyDoc_STRVAR(bytecode_roundtrip_doc,
"_bytecode_roundtrip(code) -> code\n\n"
"Decode `code` into the rewrite's instruction list and assemble it back unchanged\n"
"(a test of the bytecode layer; not a public API).");

static PyObject *
bytecode_roundtrip_py(PyObject *Py_UNUSED(module), PyObject *code)
{
    if (!PyCode_Check(code)) {
        PyErr_SetString(PyExc_TypeError, "_bytecode_roundtrip(code): code must be a code object");
        return NULL;
    }
    return bytecode_roundtrip((PyCodeObject *)code);
}

PyDoc_STRVAR(code_instructions_doc,
"code_instructions(code) -> list\n\n"
"`code` decoded as the bytecode rewrite sees it: one tuple per instruction,\n"
"(opcode, oparg, target, flags, location, handler), EXTENDED_ARG folded in, caches\n"
"dropped, jump targets and handlers as instruction indices (csrc/bytecode.h).");

static PyObject *
code_instructions(PyObject *Py_UNUSED(module), PyObject *code)
{
    if (!PyCode_Check(code)) {
        PyErr_SetString(PyExc_TypeError, "code_instructions(code): expected a code object");
        return NULL;
    }
    NnsInstrList list = {NULL, 0, 0};
    if (bytecode_decode((PyCodeObject *)code, &list) < 0) {
        return NULL;
    }
    PyObject *result = bytecode_list_to_python(&list);
    bytecode_list_clear(&list);
    return result;
}

PyDoc_STRVAR(assemble_code_doc,
"assemble_code(code, instructions, replace) -> code\n\n"
"A new code object: `code` with its bytecode, location and exception tables and\n"
"stack size made from `instructions` (tuples as code_instructions gives them) and\n"
"the fields in the dict `replace` passed to code.replace() as well.");

static PyObject *
assemble_code(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyCode_Check(args[0]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "assemble_code(code, instructions, replace): a code object, a "
                        "sequence and a dict");
        return NULL;
    }
    NnsInstrList list = {NULL, 0, 0};
    if (bytecode_list_from_python((PyCodeObject *)args[0], args[1], &list) < 0) {
        return NULL;
    }
    PyObject *result = bytecode_assemble_with((PyCodeObject *)args[0], &list, NULL, args[2]);
    bytecode_list_clear(&list);
    return result;
}

static PyObject *
py_code_state(PyObject *Py_UNUSED(module), PyObject *code)
{
    if (!PyCode_Check(code)) {
        PyErr_SetString(PyExc_TypeError, "code_state(code): expected a code object");
        return NULL;
    }
    CodeState *cs = code_state_peek((PyCodeObject *)code);
    if (cs == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *buckets = cache_tables_buckets(&cs->tables);
    if (buckets == NULL) {
        return NULL;
    }
    return Py_BuildValue("{s:O,s:O,s:i,s:O,s:N}",
                         "skip", (cs->flags & CS_SKIP) ? Py_True : Py_False,
                         "forward", (cs->flags & CS_FORWARD) ? Py_True : Py_False,
                         "n_sites", cs->n_sites,
                         "rewritten", cs->rewritten ? cs->rewritten : Py_None,
                         "buckets", buckets);
}

PyDoc_STRVAR(decide_doc,
"decide(code) -> dict\n\nDecide `code` now, as the evaluator does on first sight (rewrite\n"
"included), and return code_state(code).");

static PyObject *
py_decide(PyObject *module, PyObject *code)
{
    if (!PyCode_Check(code)) {
        PyErr_SetString(PyExc_TypeError, "decide(code): expected a code object");
        return NULL;
    }
    if (code_state_get((PyCodeObject *)code) == NULL) {
        return NULL;
    }
    return py_code_state(module, code);
}

static PyObject *
py_set_capture_code(PyObject *Py_UNUSED(module), PyObject *fn)
{
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_capture_code(fn): fn must be callable");
        return NULL;
    }
    set_global(&nns_globals.capture_code, fn);
    Py_RETURN_NONE;
}

static PyObject *
py_mark_skip(PyObject *Py_UNUSED(module), PyObject *code)
{
    if (!PyCode_Check(code)) {
        PyErr_SetString(PyExc_TypeError, "mark_skip(code): expected a code object");
        return NULL;
    }
    if (code_state_mark_skip((PyCodeObject *)code) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
py_clear_cache(PyObject *Py_UNUSED(module), PyObject *code)
{
    if (!PyCode_Check(code)) {
        PyErr_SetString(PyExc_TypeError, "clear_cache(code): expected a code object");
        return NULL;
    }
    CodeState *cs = code_state_peek((PyCodeObject *)code);
    if (cs != NULL) {
        /* Buckets owned by a compiled wrapper outlive the tables: they are retired
         * too.  A dispatch in progress holds what it uses. */
        cache_tables_retire_all(&cs->tables);
    }
    Py_RETURN_NONE;
}

static PyObject *
py_eval_frame_installed(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(arm_hook_installed());
}

static PyObject *
py_is_default_eval_frame(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(nns_get_eval_frame() == nns_default_eval_frame());
}

static PyObject *
py_armed_threads(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSsize_t(arm_open_regions());
}

static PyObject *
py_current_config(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    PyObject *config, *target;
    if (arm_current(&config, &target) < 0) {
        return NULL;
    }
    return Py_NewRef(config ? config : Py_None);
}

static PyObject *
py_dict_version(PyObject *Py_UNUSED(module), PyObject *d)
{
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "dict_version(d): expected a dict");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(nns_dict_version(d));
}

static PyObject *
py_dict_clock(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(nns_dict_clock());
}

static PyMethodDef module_methods[] = {
    {"install", (PyCFunction)(void (*)(void))py_install, METH_FASTCALL, install_doc},
    {"arm", (PyCFunction)(void (*)(void))py_arm, METH_FASTCALL, arm_doc},
    {"disarm", py_disarm, METH_O, disarm_doc},
    {"call_disarmed", (PyCFunction)(void (*)(void))py_call_disarmed,
     METH_FASTCALL | METH_KEYWORDS, call_disarmed_doc},
    {"call_hooked", (PyCFunction)(void (*)(void))hooked_call, METH_FASTCALL,
     "call_hooked(module, args, kwargs): nn.Module.__call__ with the hooks run disarmed "
     "and the forward armed (csrc/hooked_call.h)."},
    {"set_hooked_call", (PyCFunction)(void (*)(void))hooked_call_setup, METH_FASTCALL,
     "set_hooked_call(registries, _wrapped_call_impl, _call_impl, get_tracing_state)."},
    {"rewrite_code", (PyCFunction)(void (*)(void))rewrite_code, METH_FASTCALL, rewrite_code_doc},
    {"_bytecode_roundtrip", bytecode_roundtrip_py, METH_O, bytecode_roundtrip_doc},
    {"code_instructions", code_instructions, METH_O, code_instructions_doc},
    {"assemble_code", (PyCFunction)(void (*)(void))assemble_code, METH_FASTCALL,
     assemble_code_doc},
    {"code_state", py_code_state, METH_O, code_state_doc},
    {"decide", py_decide, METH_O, decide_doc},
    {"mark_skip", py_mark_skip, METH_O, "mark_skip(code): never intercept `code`."},
    {"mark_capture_code", capture_code_mark, METH_O,
     "mark_capture_code(code): code written for a capture, never replaced itself."},
    {"capture_code_mode", capture_code_set_mode, METH_O,
     "capture_code_mode(mode) -> previous: what frames of user code started on this\n"
     "thread run while it is armed for rewriting: 0 their code, 1 its capture flavour,\n"
     "2 its checked flavour (csrc/capture_code.h)."},
    {"set_capture_code", py_set_capture_code, METH_O,
     "set_capture_code(fn): fn(function, code, checked) -> code or None decides what\n"
     "frames run in capture_code_mode 1 and 2."},
    {"clear_cache", py_clear_cache, METH_O, "clear_cache(code): drop the cache entries of `code`."},
    {"eval_frame_installed", py_eval_frame_installed, METH_NOARGS,
     "True while this project's evaluator is installed."},
    {"is_default_eval_frame", py_is_default_eval_frame, METH_NOARGS,
     "True when the interpreter runs CPython's default frame evaluator."},
    {"armed_threads", py_armed_threads, METH_NOARGS,
     "Number of armed regions open now (0: the evaluator is uninstalled)."},
    {"current_config", py_current_config, METH_NOARGS, "This thread's config, or None."},
    {"dict_version", py_dict_version, METH_O, "The version tag of a dict (guards compare it)."},
    {"describe_call_key", (PyCFunction)(void (*)(void))cache_describe_call_key,
     METH_FASTCALL | METH_KEYWORDS,
     "describe_call_key(key, names=None) -> tuple of str: a CallKey or a stored CacheEntry's\n"
     "key in words, decoded from the bytes the hit path compares (no Python runs)."},
    {"call_key_layout", cache_call_key_layout, METH_O,
     "call_key_layout(key) -> tuple: per argument value, (\"tensor\", sizes offset, ndim),\n"
     "(\"int\", offset) or (\"other\", offset) in the key's bytes."},
    {"call_key_nested_layout", cache_call_key_nested_layout, METH_O,
     "call_key_nested_layout(key) -> tuple: the tensor, int and float fields inside\n"
     "structured objects, (kind, offset[, ndim], path) (guards/call_key_reader.h)."},
    {"set_key_struct_types", cache_set_key_struct_types, METH_O,
     "set_key_struct_types(classes): key instances of exactly these classes by type and\n"
     "__dict__ (transformers KV caches), not identity."},
    {"call_key_bytes", cache_call_key_bytes, METH_O,
     "call_key_bytes(key) -> bytes: what a hit compares (a CallKey or stored CacheEntry)."},
    {"shape_guards_match", cache_shape_guards_match, METH_VARARGS,
     "shape_guards_match(stored, key, wild, code) -> bool: a shape-guard program on two\n"
     "keys' bytes (tests)."},
    {"dict_clock", py_dict_clock, METH_NOARGS,
     "A number that moves when any dict a guard watches changes (3.12+; 0 on 3.11)."},
    {"record_functions_start", frame_record_start, METH_NOARGS,
     "record_functions_start() -> token: note every function that runs on this thread."},
    {"record_functions_stop", frame_record_stop, METH_O,
     "record_functions_stop(token) -> (set of functions, complete): stop noting them."},
    {"record_functions_pause", frame_record_pause, METH_NOARGS,
     "record_functions_pause() -> token: stop noting functions until resumed."},
    {"record_functions_resume", frame_record_resume, METH_O,
     "record_functions_resume(token): note functions again."},
    {"recursion_depth", recursion_depth, METH_NOARGS,
     "recursion_depth() -> int: units of the recursion limit in use at the calling frame."},
    {"call_at_depth", (PyCFunction)(void (*)(void))call_at_depth,
     METH_FASTCALL | METH_KEYWORDS,
     "call_at_depth(depth, fn, /, *args, **kwargs): fn(*args, **kwargs) with the\n"
     "recursion budget of a call made from a frame at `depth` (csrc/recursion.h)."},
    {"call_with_mode_replaced", (PyCFunction)(void (*)(void))call_with_mode_replaced,
     METH_FASTCALL | METH_KEYWORDS,
     "call_with_mode_replaced(mode, stand_in, fn, /, *args, **kwargs): fn(*args, **kwargs)\n"
     "with torch function mode `mode` replaced by `stand_in` meanwhile if it is on top."},
    {"call_holding", (PyCFunction)(void (*)(void))call_holding,
     METH_FASTCALL | METH_KEYWORDS,
     "call_holding(lock, fn, /, *args, **kwargs): fn(*args, **kwargs) with `lock` held,\n"
     "acquired and released in C: no interrupt can land between (csrc/held_lock.h)."},
    {"call_without_collections", (PyCFunction)(void (*)(void))call_without_collections,
     METH_FASTCALL | METH_KEYWORDS,
     "call_without_collections(fn, /, *args, **kwargs): fn(*args, **kwargs) with no\n"
     "automatic garbage collection meanwhile, resumed in C (csrc/paused_collections.h)."},
    {"_stack_room", recursion_stack_room, METH_NOARGS,
     "_stack_room() -> (free, size): C stack bytes left here and the thread's stack size."},
    {NULL, NULL, 0, NULL},
};

static int
add_type(PyObject *module, PyTypeObject *type, const char *name)
{
    if (PyType_Ready(type) < 0) {
        return -1;
    }
    return PyModule_AddObjectRef(module, name, (PyObject *)type);
}

static PyObject *
intern(const char *s)
{
    return PyUnicode_InternFromString(s);
}

static int
module_exec(PyObject *module)
{
    static int initialised;
    if (initialised) {
        PyErr_SetString(PyExc_ImportError,
                        "nnscaler_eval._C can be loaded once per process (one interpreter)");
        return -1;
    }
    if (code_state_init() < 0 ||
        /* 1 when the evaluator reads co_extra without calling CPython (code_state.h);
         * the tests expect it on every audited version */
        PyModule_AddIntConstant(module, "CO_EXTRA_DIRECT", code_state_direct) < 0) {
        return -1;
    }
    /* The value-guard kinds (guards/value_guards.h): state_guards.py reads them here,
     * the one source of their numbers. */
    if (PyModule_AddIntConstant(module, "VG_DICT", VG_DICT) < 0 ||
        PyModule_AddIntConstant(module, "VG_LIST", VG_LIST) < 0 ||
        PyModule_AddIntConstant(module, "VG_CELL", VG_CELL) < 0 ||
        PyModule_AddIntConstant(module, "VG_FUNCTION", VG_FUNCTION) < 0 ||
        PyModule_AddIntConstant(module, "VG_TENSOR", VG_TENSOR) < 0 ||
        PyModule_AddIntConstant(module, "VG_CALL", VG_CALL) < 0 ||
        PyModule_AddIntConstant(module, "VG_TENSORS", VG_TENSORS) < 0 ||
        PyModule_AddIntConstant(module, "VG_BYTES", VG_BYTES) < 0 ||
        PyModule_AddIntConstant(module, "VG_SLOTS", VG_SLOTS) < 0) {
        return -1;
    }
    /* The shape-guard opcodes (guards/shape_guards.h), for capture/dynamic.py. */
    struct { const char *name; int op; } sg_ops[] = {
        {"SG_LOAD", SG_LOAD}, {"SG_CONST", SG_CONST}, {"SG_ADD", SG_ADD},
        {"SG_SUB", SG_SUB}, {"SG_MUL", SG_MUL}, {"SG_FLOORDIV", SG_FLOORDIV},
        {"SG_MOD", SG_MOD}, {"SG_POW", SG_POW}, {"SG_NEG", SG_NEG}, {"SG_MAX", SG_MAX},
        {"SG_MIN", SG_MIN}, {"SG_EQ", SG_EQ}, {"SG_NE", SG_NE}, {"SG_LT", SG_LT},
        {"SG_LE", SG_LE}, {"SG_GT", SG_GT}, {"SG_GE", SG_GE}, {"SG_AND", SG_AND},
        {"SG_OR", SG_OR}, {"SG_NOT", SG_NOT}, {"SG_CHECK", SG_CHECK},
        {"SG_CHECK_GE_CONST", SG_CHECK_GE_CONST}, {"SG_CHECK_LE_CONST", SG_CHECK_LE_CONST},
        {"SG_CHECK_EQ_CONST", SG_CHECK_EQ_CONST}, {"SG_CHECK_EQ_LOAD", SG_CHECK_EQ_LOAD},
    };
    for (size_t i = 0; i < sizeof(sg_ops) / sizeof(sg_ops[0]); i++) {
        if (PyModule_AddIntConstant(module, sg_ops[i].name, sg_ops[i].op) < 0) {
            return -1;
        }
    }
    struct { PyObject **slot; const char *s; } names[] = {
        {&guard_env.str_training, "training"},
        {&nns_globals.str_forward, "forward"},
        {&nns_globals.str_wrapped, "__wrapped__"},
        {&nns_globals.str_call_impl, "_call_impl"},
        {&guard_env.str_dtype, "dtype"},
        {&guard_env.str_shape, "shape"},
        {&guard_env.str_stride, "stride"},
        {&guard_env.str_device, "device"},
        {&guard_env.str_requires_grad, "requires_grad"},
        {&nns_globals.str_forward_hooks, "_forward_hooks"},
        {&nns_globals.str_forward_pre_hooks, "_forward_pre_hooks"},
        {&nns_globals.str_backward_hooks, "_backward_hooks"},
        {&nns_globals.str_backward_pre_hooks, "_backward_pre_hooks"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if ((*names[i].slot = intern(names[i].s)) == NULL) {
            return -1;
        }
    }
    if (add_type(module, &CacheEntry_Type, "CacheEntry") < 0 ||
        add_type(module, &CacheBucket_Type, "CacheBucket") < 0 ||
        add_type(module, &CacheTable_Type, "CacheTable") < 0 ||
        add_type(module, &CallKey_Type, "CallKey") < 0 ||
        add_type(module, &ModuleCall_Type, "ModuleCall") < 0 ||
        add_type(module, &CompiledFunction_Type, "CompiledFunction") < 0 ||
        add_type(module, &GraphReplay_Type, "GraphReplay") < 0 ||
        eval_frame_init(module) < 0) {
        return -1;
    }
    initialised = 1;
    return 0;
}

static struct PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "nnscaler_eval._C",
    .m_doc = "C core of nnscaler-eval: PEP 523 frame evaluator, bytecode rewrite, guards.",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = module_slots,
};

PyMODINIT_FUNC
PyInit__C(void)
{
    return PyModuleDef_Init(&module_def);
}
