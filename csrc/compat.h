/* compat.h - the one place where CPython versions are told apart.
 *
 * Everything that changed between CPython minor versions (frame layout, how a frame
 * is owned, opcode numbers and inline-cache sizes, dict version tags) is reached
 * through the names below.  Each supported minor version has its own file,
 * compat_py3XX.c, holding the code that reads that version's internals; no other
 * file tests PY_VERSION_HEX (tests/test_lint.py checks this).
 *
 * Ownership: unless a comment says otherwise, every function here returns a
 * BORROWED reference and never raises.
 */
#ifndef NNSCALER_COMPAT_H
#define NNSCALER_COMPAT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
/* CPython 3.11: audited against v3.11.7 (compat_py311.c). Tested. */
#  define NNS_PY311 1
#elif PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030D0000
/* CPython 3.12: written from v3.12.7's sources (compat_py312.c). UNTESTED: no 3.12
 * interpreter was available where it was written. */
#  define NNS_PY312 1
#elif PY_VERSION_HEX >= 0x030D0000 && PY_VERSION_HEX < 0x030E0000
/* CPython 3.13: audited against v3.13.15 (compat_py313.c). Tested. */
#  define NNS_PY313 1
#elif PY_VERSION_HEX >= 0x030E0000 && PY_VERSION_HEX < 0x030F0000
/* CPython 3.14: audited against v3.14.10 (compat_py314.c). Tested. */
#  define NNS_PY314 1
#else
#  error "nnscaler-eval: unaudited CPython version; frame internals must be checked first"
#endif

#ifdef Py_GIL_DISABLED
/* The evaluator's per-thread state and the dict-watcher side table rely on the GIL. */
#  error "nnscaler-eval: free-threaded CPython builds are not supported"
#endif

/* The frame type handed to a PEP 523 evaluator. Opaque outside compat_py3XX.c. */
struct _PyInterpreterFrame;
typedef struct _PyInterpreterFrame NnsFrame;

/* Frame accessors (borrowed). */
PyCodeObject *nns_frame_code(NnsFrame *frame);
PyObject *nns_frame_function(NnsFrame *frame);   /* the PyFunctionObject, or NULL */
/* The frame's argument slots as an array of PyObject *: entries [0, n) where n is
 * the code's parameter count (+1 for *args, +1 for **kwargs) are the bound arguments
 * (borrowed); later entries must not be read.  NULL with MemoryError only on 3.14,
 * whose first read in a bracket copies them (later reads in it cannot fail).  Only inside the
 * frame's nns_frame_run_enter/leave bracket (below), and valid until it is left.
 * On 3.14 the slots are tagged _PyStackRef values (a set low bit marks a reference
 * not counted on the object, e.g. an immortal; the tags must stay, the interpreter
 * compares tagged bits): the array is then an untagged copy kept in the bracket. */
PyObject **nns_frame_localsplus(NnsFrame *frame);
/* nns_frame_code without a call, for the evaluator's fast path: the word at
 * `nns_frame_code_offset` in the frame, less the tag bits in `nns_frame_code_tag`
 * (3.14's tagged stack references; none before).  Each version file derives both
 * from the struct field and macro its nns_frame_code reads, so the two agree by
 * construction (eval_frame.c asserts it in debug builds). */
extern const size_t nns_frame_code_offset;
extern const uintptr_t nns_frame_code_tag;

static inline PyCodeObject *
nns_frame_code_inline(NnsFrame *frame)
{
    uintptr_t word = *(const uintptr_t *)(const void *)((const char *)frame + nns_frame_code_offset);
    return (PyCodeObject *)(word & ~nns_frame_code_tag);
}

/* True when the frame belongs to a generator/coroutine (never intercepted). */
int nns_frame_is_generator(NnsFrame *frame);

/* The default evaluator of this interpreter version.  Also records, for the
 * enclosing nns_frame_run_leave(), that `frame` was handed over (CPython then clears
 * and pops it). */
PyObject *nns_eval_frame_default(PyThreadState *ts, NnsFrame *frame, int throw_flag);
/* Inside a trace or profile callback right now (frames started there are left alone). */
int nns_thread_in_trace_callback(PyThreadState *ts);

/* Bracket around a PEP 523 evaluator that may return without running its frame:
 *
 *     NnsFrameRun run;
 *     nns_frame_run_enter(&run, frame);
 *     result = ... (maybe nns_eval_frame_default(ts, frame, ...), maybe not) ...;
 *     return nns_frame_run_leave(ts, &run, result);
 *
 * On 3.11 _PyEval_Vector clears and pops the frame after the evaluator returns; from
 * 3.12 on the evaluator owns that, and a frame not handed to the default evaluator
 * must be cleared and popped by whoever returns for it.  nns_frame_run_leave does
 * that when nns_eval_frame_default(frame) was not called in between (a no-op on
 * 3.11).  Brackets nest per thread; `run` lives on the caller's C stack.  Returns
 * `result` (ownership passes through; an exception set with NULL stays set). */
typedef struct NnsFrameRun {
    NnsFrame *frame;
    int handed;
    struct NnsFrameRun *outer;
    /* 3.14: the argument slots untagged (see nns_frame_localsplus), or NULL */
    PyObject **args;
    PyObject *args_small[8];
} NnsFrameRun;
void nns_frame_run_enter(NnsFrameRun *run, NnsFrame *frame);
PyObject *nns_frame_run_leave(PyThreadState *ts, NnsFrameRun *run, PyObject *result);

/* "Has this dict changed since I looked?"  nns_dict_version(dict) returns a number;
 * a later call returns a different number if the dict was modified in between (any
 * insert, update, delete, clear or clone into it).  Numbers are never reused for
 * another dict, so a snapshot taken from a dict that was freed and whose address was
 * reused does not match the new dict.  Never raises.
 *   3.11: ma_version_tag (PEP 509), free.
 *   3.12+: version tags are deprecated (3.12, 3.13) and gone (3.14): the first call
 *   on a dict starts watching it with a PyDict watcher (one per process, never
 *   removed) and records it in a side table, dict -> number; the watcher gives the
 *   dict a new number on every change and drops it from the table when the dict is
 *   freed.  If the side table cannot grow (no memory) the call returns a fresh
 *   number each time, so a guard built on it fails closed (a cache miss). */
uint64_t nns_dict_version(PyObject *dict);

/* "Has any dict I took a version of changed since?"  3.12+: a number that moves
 * whenever a watched dict (one nns_dict_version was called on) changes, is freed, or
 * starts being watched, so a cache entry that saw all its dicts unchanged at clock c
 * needs no per-dict check while the clock still reads c: one comparison per entry,
 * whatever the model's depth.  3.11: 0, always (its version tags move on any dict
 * change in the process: each dict is checked). */
uint64_t nns_dict_clock(void);

/* 1 when changes to `dict` move nns_dict_clock (it is watched now, watching it first
 * if need be), 0 when they may not (3.11, or watching failed).  Never raises. */
int nns_dict_watched(PyObject *dict);

/* Used only by the compat files: clear a frame that was never run and pop it off
 * the thread's frame stack (what the default evaluator does on exit).  A no-op on
 * 3.11, where _PyEval_Vector does it. */
void nns_frame_clear_and_pop(PyThreadState *ts, NnsFrame *frame);
/* Used only by the compat files: nns_eval_frame_default() calls it first. */
void nns_frame_run_mark_handed(NnsFrame *frame);
/* Used only by the compat files: the innermost bracket, if it is `frame`'s. */
NnsFrameRun *nns_frame_run_of(NnsFrame *frame);

/* The code-object extra-data API (PEP 523), renamed PyUnstable_* in 3.12 with the
 * old private names deprecated. */
static inline Py_ssize_t
nns_code_request_extra_index(freefunc free_extra)
{
#ifdef NNS_PY311
    return _PyEval_RequestCodeExtraIndex(free_extra);
#else
    return PyUnstable_Eval_RequestCodeExtraIndex(free_extra);
#endif
}

static inline int
nns_code_get_extra(PyObject *code, Py_ssize_t index, void **extra)
{
#ifdef NNS_PY311
    return _PyCode_GetExtra(code, index, extra);
#else
    return PyUnstable_Code_GetExtra(code, index, extra);
#endif
}

static inline int
nns_code_set_extra(PyObject *code, Py_ssize_t index, void *extra)
{
#ifdef NNS_PY311
    return _PyCode_SetExtra(code, index, extra);
#else
    return PyUnstable_Code_SetExtra(code, index, extra);
#endif
}

/* One slot of co_extra read without a call, for the evaluator's every frame.  The
 * holder is private to Objects/codeobject.c (_PyCodeObjectExtra: the slot count,
 * then the slots), the same in v3.11.7, v3.12.7, v3.13.15 and v3.14.10; `co_extra`
 * itself is a public field.  code_state.c checks the layout once, against what the
 * public setter stored, before relying on it.  Never raises, runs no Python. */
typedef struct {
    Py_ssize_t size;
    void *slots[1];
} NnsCodeExtraHolder;

static inline void *
nns_code_extra_read(PyCodeObject *code, Py_ssize_t index)
{
    const NnsCodeExtraHolder *holder = (const NnsCodeExtraHolder *)code->co_extra;
    return holder != NULL && index < holder->size ? holder->slots[index] : NULL;
}

/* The object a weak reference points to, borrowed, or Py_None once it is dead: what
 * PyWeakref_GET_OBJECT gave before 3.13 deprecated it.  Never raises. */
static inline PyObject *
nns_weakref_object(PyObject *ref)
{
#if defined(NNS_PY311) || defined(NNS_PY312)
    return PyWeakref_GET_OBJECT(ref);
#else
    /* What the deprecated macro did, from the struct in Include/cpython/
     * weakrefobject.h (unchanged 3.11-3.14): a cleared reference points to None, and
     * a referent already in its deallocator (refcount 0, weakrefs not yet cleared)
     * counts as dead, as in PyWeakref_GetRef.  No new reference taken and dropped:
     * state guards read one per module per hit. */
    PyObject *obj = ((PyWeakReference *)ref)->wr_object;
    return obj == Py_None || Py_REFCNT(obj) == 0 ? Py_None : obj;
#endif
}

/* The instance __dict__ of `obj`, borrowed, or NULL when it has none (a dict of
 * inline values is materialised first).  Runs no Python, never raises. */
static inline PyObject *
nns_object_dict(PyObject *obj)
{
    PyObject **dictptr = _PyObject_GetDictPtr(obj);
    return dictptr != NULL ? *dictptr : NULL;
}

/* Where `obj` keeps its instance __dict__ pointer, as an offset from the object,
 * when every instance of its class keeps it there (a managed dict, or a positive
 * tp_dictoffset), else 0.  Materialises a dict of inline values (as nns_object_dict).
 * Runs no Python, never raises. */
static inline Py_ssize_t
nns_object_dict_offset(PyObject *obj)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (!(tp->tp_flags & Py_TPFLAGS_MANAGED_DICT) && tp->tp_dictoffset <= 0) {
        return 0;
    }
    PyObject **dictptr = _PyObject_GetDictPtr(obj);
    return dictptr != NULL ? (Py_ssize_t)((char *)dictptr - (char *)obj) : 0;
}

/* nns_object_dict(obj) for an instance of the class `offset` was taken from
 * (nns_object_dict_offset): one load.  Runs no Python, never raises. */
static inline PyObject *
nns_object_dict_at(PyObject *obj, Py_ssize_t offset)
{
    return offset != 0 ? *(PyObject **)((char *)obj + offset) : nns_object_dict(obj);
}

/* 1 when reading attribute `name` (an interned str) of an instance of `tp` finds
 * an instance __dict__ entry first, running no Python to get there: the type's
 * __getattribute__ is object's and `name` is no data descriptor (property) on the
 * type.  Cached per (type, name) under the type's version tag, so a class changed
 * later is looked at again.  Runs no Python, never raises. */
int nns_type_reads_instance_dict(PyTypeObject *tp, PyObject *name);

/* Borrowed attribute `name` of `tp` found along its MRO without calling anything
 * (_PyType_Lookup), or NULL.  Runs no Python, never raises. */
static inline PyObject *
nns_type_lookup(PyTypeObject *tp, PyObject *name)
{
    return _PyType_Lookup(tp, name);
}

/* ---- the PEP 523 slot and the thread state (the same API 3.11-3.14) ---- */

/* The evaluator function type of PEP 523 (_PyFrameEvalFunction, unchanged since
 * 3.11; compat_py3XX.c passes NnsFrame for the version's frame struct). */
typedef _PyFrameEvalFunction NnsEvalFrameFunc;

/* The interpreter's evaluator, and CPython's own.  Run no Python. */
static inline NnsEvalFrameFunc
nns_get_eval_frame(void)
{
    return _PyInterpreterState_GetEvalFrameFunc(PyInterpreterState_Get());
}

static inline void
nns_set_eval_frame(NnsEvalFrameFunc f)
{
    _PyInterpreterState_SetEvalFrameFunc(PyInterpreterState_Get(), f);
}

static inline NnsEvalFrameFunc
nns_default_eval_frame(void)
{
    return _PyEval_EvalFrameDefault;
}

/* Hand `frame` to CPython's evaluator from the hook's fast path, outside any
 * nns_frame_run_enter/leave bracket of its own (so nothing is recorded: only a
 * bracket's own frame can be handed over, nns_eval_frame_default).  Runs Python. */
static inline PyObject *
nns_eval_frame_passthrough(PyThreadState *ts, NnsFrame *frame, int throw_flag)
{
    return _PyEval_EvalFrameDefault(ts, frame, throw_flag);
}

/* Thread-state fields the arming cache keys on (cpython/pystate.h, unchanged in
 * 3.11-3.14): the thread's unique id, its current context (borrowed, may be NULL)
 * and the version CPython bumps whenever the thread enters or leaves a context. */
static inline uint64_t
nns_thread_id(PyThreadState *ts)
{
    return ts->id;
}

static inline PyObject *
nns_thread_context(PyThreadState *ts)
{
    return ts->context;
}

static inline uint64_t
nns_thread_context_version(PyThreadState *ts)
{
    return ts->context_ver;
}

/* ---- the thread's recursion counter (used by recursion.c) ----
 * The counter behind sys.getrecursionlimit(): 3.11 has one per thread
 * (recursion_remaining) charged by Python frames and by C-level recursive calls
 * alike; 3.12+ charge Python frames to py_recursion_remaining and C calls elsewhere
 * (c_recursion_remaining on 3.12 and 3.13, a stack-pointer check on 3.14), so there
 * it is a count of Python frames only.  Neither function ever raises; neither touches
 * the limit itself (sys.getrecursionlimit() reads the same before and after). */
/* Units of the limit this thread has in use now. */
int nns_recursion_used(PyThreadState *ts);
/* Moves this thread's counter by `units`: > 0 gives the thread that many more units
 * before RecursionError, < 0 takes them back.  Every call is undone by its
 * opposite on the same thread (recursion.c). */
void nns_recursion_credit(PyThreadState *ts, int units);
/* Units one call of a METH_NOARGS builtin charges to that counter while it runs:
 * 1 on 3.11 (Objects/methodobject.c, cfunction_enter_call), 0 on 3.12+ (charged to
 * the C counter, or not counted). */
extern const int nns_recursion_builtin_call_units;

/* ---- bytecode tables (filled per version) ---- */
typedef struct {
    int cache_entries[256];   /* inline CACHE code units after each opcode */
    /* opcode numbers this project emits or matches; -1 when absent in a version */
    int op_cache, op_extended_arg, op_nop;
    int op_load_fast, op_load_deref, op_load_classderef, op_load_attr, op_load_const;
    int op_load_fast_check;   /* 3.12+ */
    int op_load_fast_borrow;  /* 3.14 */
    /* superinstructions loading two locals (3.13+): oparg >> 4, then oparg & 15;
     * each splits into two of the matching single load */
    int op_load_fast_load_fast, op_load_fast_borrow_load_fast_borrow;
    int op_pop_jump_forward_if_false, op_pop_jump_forward_if_true;
    int op_to_bool;           /* 3.13+: turns the condition into a bool before a jump */
    int op_not_taken;         /* 3.14: marks the fall-through edge of a branch */
    int op_jump_forward, op_jump_backward, op_jump_backward_no_interrupt;
    int op_push_null, op_precall, op_call, op_call_function_ex, op_swap;
    int op_store_fast, op_kw_names, op_copy;
    int op_jump_if_true_or_pop, op_jump_if_false_or_pop;
    /* Call shape: 1 when the NULL goes below the callable (3.11, 3.12: PUSH_NULL,
     * callable, args), 0 when above it (3.13+: callable, NULL, args). */
    int call_null_below_callable;
    int op_pop_top;
    /* 1 when the compiler copies small exit blocks into the branches jumping to them
     * (3.12+: Python/flowgraph.c, inline_small_or_no_lineno_blocks) */
    int exit_blocks_copied;
    /* 1 when the compiler writes one location entry for a run of instructions with
     * the same location (3.12+), 0 for one per instruction (3.11) */
    int linetable_merges_runs;
    int have_argument;        /* opcodes >= this take an argument */
} NnsOpcodes;

extern const NnsOpcodes nns_opcodes;

/* Jump classification: 0 = not a jump, 1 = relative forward, 2 = relative backward,
 * 3 = absolute. Unconditional jumps also set *unconditional. */
int nns_opcode_jump_kind(int opcode, int *unconditional);
/* Opcodes after which control never falls through (return, raise, reraise, jumps). */
int nns_opcode_is_terminator(int opcode);
/* Stack effect: CPython's own table (PyCompile_OpcodeStackEffectWithJump). */
int nns_opcode_stack_effect(int opcode, int oparg, int jump);
/* Opcodes that call a Python-level callable (a branch holding one is not rewritten). */
int nns_opcode_is_call(int opcode);
/* Opcodes that store or delete a name (side effects a rewritten branch may not have). */
int nns_opcode_is_store(int opcode);

/* ---- code-object details that moved between versions ---- */
/* Name of fast-locals slot `index` (the oparg of LOAD_FAST / LOAD_DEREF /
 * LOAD_CLASSDEREF): a local, cell or free variable.  Borrowed; NULL when out of
 * range. */
PyObject *nns_code_localsplus_name(PyCodeObject *code, int index);
/* Index into co_names named by a LOAD_ATTR oparg (3.12 moved a flag into bit 0). */
int nns_load_attr_name_index(int oparg);
/* Stack depth on entry to the code's first instruction, for stack-depth analysis.
 * Non-zero for generator-like code on 3.11 (and 3.12): RETURN_GENERATOR's table effect is 0,
 * yet the resumed frame finds the sent value on the stack (popped by the next
 * POP_TOP). */
int nns_code_entry_stack_depth(PyCodeObject *code);

#endif /* NNSCALER_COMPAT_H */
