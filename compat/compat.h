/* compat.h - the shim's (csrc/) view of the version layer, compat/.
 *
 * Everything that changed between CPython minor versions (frame layout, how a frame
 * is owned, opcode numbers and inline-cache sizes, dict version tags) is reached
 * through the names below and those of compat_objects.h, which this includes.  The
 * versions are told apart in one place, compat_versions.h; each supported minor
 * version has its own file, compat_py3XX.c, holding the code that reads that
 * version's internals.  Outside compat/ no file tests a version (tests/test_lint.py
 * checks this).
 *
 * Ownership: unless a comment says otherwise, every function here returns a
 * BORROWED reference and never raises.
 */
#ifndef NNSCALER_COMPAT_H
#define NNSCALER_COMPAT_H

#include "compat_objects.h"   /* compat_versions.h, and the object-level names */

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

/* ---- bytecode tables (compat_opcodes.c: one for every version) ---- */
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

/* ---- code-object details that moved between versions (compat_opcodes.c) ---- */
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
