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
/* CPython 3.11: audited against v3.11.7 (Include/internal/pycore_frame.h,
 * Python/ceval.c).  Primary version, fully tested. */
#  define NNS_PY311 1
#elif PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030D0000
#  error "nnscaler-eval: CPython 3.12 is not audited yet (no 3.12 interpreter to test with)"
#elif PY_VERSION_HEX >= 0x030D0000 && PY_VERSION_HEX < 0x030F0000
#  error "nnscaler-eval: CPython 3.13/3.14 support is not written yet; see README 'Status'"
#else
#  error "nnscaler-eval: unaudited CPython version; frame internals must be checked first"
#endif

/* The frame type handed to a PEP 523 evaluator. Opaque outside compat_py3XX.c. */
struct _PyInterpreterFrame;
typedef struct _PyInterpreterFrame NnsFrame;

/* Frame accessors (borrowed). */
PyCodeObject *nns_frame_code(NnsFrame *frame);
PyObject *nns_frame_function(NnsFrame *frame);   /* the PyFunctionObject, or NULL */
PyObject **nns_frame_localsplus(NnsFrame *frame);
/* True when the frame belongs to a generator/coroutine (never intercepted). */
int nns_frame_is_generator(NnsFrame *frame);

/* The default evaluator of this interpreter version. */
PyObject *nns_eval_frame_default(PyThreadState *ts, NnsFrame *frame, int throw_flag);
/* Inside a trace or profile callback right now (frames started there are left alone). */
int nns_thread_in_trace_callback(PyThreadState *ts);

/* Dict version: a number that changes whenever the dict is modified. On 3.11 this is
 * ma_version_tag (PEP 509). */
uint64_t nns_dict_version(PyObject *dict);

/* ---- bytecode tables (filled per version) ---- */
typedef struct {
    int cache_entries[256];   /* inline CACHE code units after each opcode */
    /* opcode numbers this project emits or matches; -1 when absent in a version */
    int op_cache, op_extended_arg, op_nop;
    int op_load_fast, op_load_deref, op_load_classderef, op_load_attr, op_load_const;
    int op_pop_jump_forward_if_false, op_pop_jump_forward_if_true;
    int op_jump_forward, op_jump_backward, op_jump_backward_no_interrupt;
    int op_push_null, op_precall, op_call, op_call_function_ex, op_swap;
    int op_store_fast, op_kw_names, op_copy;
    int op_jump_if_true_or_pop, op_jump_if_false_or_pop;
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
 * Non-zero for generator-like code on 3.11: RETURN_GENERATOR's table effect is 0,
 * yet the resumed frame finds the sent value on the stack (popped by the next
 * POP_TOP). */
int nns_code_entry_stack_depth(PyCodeObject *code);

#endif /* NNSCALER_COMPAT_H */
