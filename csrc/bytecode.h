/* bytecode.h - a code object's bytecode as an editable list of instructions.
 *
 * bytecode_decode() turns co_code into one NnsInstr per instruction: EXTENDED_ARG
 * prefixes folded into the oparg, inline CACHE entries dropped, jump targets turned
 * into instruction indices, and each instruction's source location (co_linetable)
 * and exception handler (co_exceptiontable) attached to it.  A pass may then insert,
 * drop and reorder instructions freely, as long as it keeps `target` and
 * `handler.target` pointing at instructions of the list.
 *
 * bytecode_assemble() goes back: it sizes EXTENDED_ARG prefixes until jump offsets
 * stop moving, writes zeroed CACHE entries, re-encodes the location and exception
 * tables, computes co_stacksize by flow analysis, and builds the new code object with
 * code.replace() so that every field it does not produce stays as it was.
 *
 * The location table (PEP 657) and exception table formats are those of CPython 3.11,
 * unchanged through 3.14 (3.12+ write one location entry per run of equal
 * locations); opcode numbers, cache sizes and such choices come from compat.h.
 *
 * Ownership: every function returning PyObject * returns a NEW reference, or NULL
 * with an exception set.  Functions returning int return 0 on success and -1 with an
 * exception set.  NnsInstrList owns its array (PyMem); bytecode_list_clear() frees it.
 */
#ifndef NNSCALER_BYTECODE_H
#define NNSCALER_BYTECODE_H

#include "compat.h"

/* A source location, as co_positions() yields it.  Columns are -1 when absent. */
typedef struct {
    int has_line;       /* 0: the instruction has no location at all */
    int line;
    int end_line;
    int col;
    int end_col;
} NnsLocation;

static inline int
bytecode_same_location(const NnsLocation *a, const NnsLocation *b)
{
    if (!a->has_line || !b->has_line) {
        return a->has_line == b->has_line;
    }
    return a->line == b->line && a->end_line == b->end_line && a->col == b->col
           && a->end_col == b->end_col;
}

/* The exception handler covering an instruction (co_exceptiontable entry). */
typedef struct {
    int target;         /* instruction index of the handler; -1: no handler */
    int depth;          /* stack depth the handler unwinds to */
    int lasti;          /* push the offset of the raising instruction first */
} NnsHandler;

static inline int
bytecode_same_handler(const NnsHandler *a, const NnsHandler *b)
{
    return a->target == b->target && a->depth == b->depth && a->lasti == b->lasti;
}

/* Set on instructions a pass inserted (so that a later pass can tell them from the
 * user's own, e.g. the ifexpr call from a call written in the source). */
#define NNS_INSTR_INSERTED 0x1

typedef struct {
    int opcode;
    int oparg;          /* for jumps: recomputed from `target` when assembling */
    int target;         /* jump target as an instruction index; -1 if not a jump */
    int flags;
    NnsLocation loc;
    NnsHandler handler;
} NnsInstr;

typedef struct {
    NnsInstr *items;
    int n;
    int cap;
} NnsInstrList;

/* Free the list's array and empty it (safe on a zeroed or already cleared list). */
void bytecode_list_clear(NnsInstrList *list);

/* Append a copy of `instr`. */
int bytecode_list_append(NnsInstrList *list, const NnsInstr *instr);

/* Decode `code` into `out` (which must be empty).  ValueError naming the code when
 * the bytecode has a shape this layer cannot represent (a jump into the middle of an
 * instruction, a truncated table). */
int bytecode_decode(PyCodeObject *code, NnsInstrList *out);

/* Instruction index reached from `index` by following unconditional jumps; -1 when
 * they loop.  Never raises. */
int bytecode_resolve_jumps(const NnsInstrList *list, int index);

/* Assemble `list` into a new code object: `code` with co_code, co_linetable,
 * co_exceptiontable and co_stacksize replaced, and co_consts replaced by `consts`
 * when it is not NULL (borrowed).  May run Python: code.replace() is called through
 * the object protocol, and the allocations can start the GC. */
PyObject *bytecode_assemble(PyCodeObject *code, const NnsInstrList *list, PyObject *consts);

/* bytecode_assemble() with `extra` (a dict, borrowed, may be NULL) passed to
 * code.replace() too: other fields of the new code object (co_varnames,
 * co_argcount, co_name...), for code built from pieces of another (the branch
 * functions of capture/branches.py). */
PyObject *bytecode_assemble_with(PyCodeObject *code, const NnsInstrList *list,
                                 PyObject *consts, PyObject *extra);

/* The list as a Python list of tuples
 *     (opcode, oparg, target, flags, location, handler)
 * location: (line, end_line, col, end_col) or None; handler: (target, depth, lasti)
 * or None; targets are instruction indices or -1.  New reference. */
PyObject *bytecode_list_to_python(const NnsInstrList *list);

/* The inverse: fill `out` (empty) from such a sequence, checking that every target
 * and handler names an instruction of it; ValueError naming `code` otherwise. */
int bytecode_list_from_python(PyCodeObject *code, PyObject *seq, NnsInstrList *out);

/* Decode and re-assemble `code` unchanged: a check of this layer (tests compare the
 * result's co_code, positions, exception table and stack size with the original). */
PyObject *bytecode_roundtrip(PyCodeObject *code);

/* Raise `exc_type` with the formatted message followed by
 * " (in <co_qualname> at <co_filename>:<co_firstlineno>)".  Always returns -1. */
int bytecode_code_error(PyCodeObject *code, PyObject *exc_type, const char *format, ...);

#endif /* NNSCALER_BYTECODE_H */
