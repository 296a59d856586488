/* code_state.h - what this project knows about one code object, kept in co_extra.
 *
 * Decided once per code object on first sight and freed with the code object.
 * The CodeState never holds a reference that leads back to its own code object
 * (that cycle would be invisible to the GC, since co_extra is not traversed).
 */
#ifndef NNSCALER_CODE_STATE_H
#define NNSCALER_CODE_STATE_H

#include "compat.h"
#include "cache_table.h"
#include "nns_globals.h"

enum {
    CS_SKIP = 1 << 0,        /* never intercepted: generators, class bodies, our own code */
    CS_FORWARD = 1 << 1,     /* a module forward: named "forward" with a first argument,
                              * or found to be what `self.forward` is for an nn.Module
                              * (code_state_learn_forward) */
    CS_PLAIN = 1 << 2,       /* decided: neither a forward nor rewritten, so its frames
                              * run as they are unless the code is a region's target */
    CS_CAPTURE_CODE = 1 << 3,   /* written for a capture (capture_code.h): never replaced */
};

typedef struct CodeState {
    unsigned flags;
    int n_sites;              /* rewritten self.training sites */
    PyObject *rewritten;      /* owned: code to run in place of this one, or NULL */
    /* owned: what its frames run while a capture records, per mode (capture_code.h:
     * [0] the capture flavour, [1] the checked one), or NULL; decided once each */
    PyObject *capture_code[2];
    unsigned char capture_known[2];
    /* one CacheTable per capture config, found by config in O(1); a table finds
     * the bucket of an owner (`self`, or the function object of a compiled
     * function) in O(1) (guards/cache_table.h) */
    CacheTableSet tables;
} CodeState;

/* Index into co_extra; must be called once at module init. -1 on error. */
int code_state_init(void);

/* The CodeState of `code`, created and decided on first sight. Borrowed (owned by
 * the code object, freed only with it, so it stays valid across Python run by
 * the caller while the code object is alive). NULL with an exception set on
 * failure.  May run Python: a failed rewrite is reported as a warning. */
CodeState *code_state_get(PyCodeObject *code);

/* Mark `code` a module forward when it is the code `module.forward` calls: the
 * class's function of that name, or an instance attribute `forward` that is a
 * function or a method bound to the module (`forward = fwd` in a class body,
 * `self.forward = self.helper`), whatever the code's own name, followed through
 * `__wrapped__` (decorators).  Skipped code and code taking no argument are left as
 * they are.  May run Python: a key's __eq__ in the instance dict, and the GC when a
 * function's __dict__ is made; it holds its own references across that (the caller
 * must own `code` and `module`).  Never raises (an error is cleared: the code is then
 * simply not learned as a forward). */
void code_state_learn_forward(CodeState *cs, PyCodeObject *code, PyObject *module);

/* Mark `code` as never intercepted (rewritten code, generated graph code). 0 / -1.
 * Runs no Python. */
int code_state_mark_skip(PyCodeObject *code);

/* code_state_peek through the public getter (a call into CPython). */
CodeState *code_state_peek_api(PyCodeObject *code);
/* 1 once code_state_init found co_extra readable without a call. */
extern int code_state_direct;

/* The existing CodeState read without a call, or NULL (none, or co_extra is not
 * readable that way here: code_state_peek then asks CPython).  Never raises. */
static inline CodeState *
code_state_peek_direct(PyCodeObject *code)
{
    return code_state_direct
        ? (CodeState *)nns_code_extra_read(code, nns_globals.code_extra_index) : NULL;
}

/* The existing CodeState or NULL; never creates one, never raises.  Inline: the
 * evaluator's every frame asks. */
static inline CodeState *
code_state_peek(PyCodeObject *code)
{
    return code_state_direct ? code_state_peek_direct(code) : code_state_peek_api(code);
}

/* 1 when a frame of `code` (whose state is `cs`) runs as it is in a region armed
 * with `target` (borrowed, may be NULL), whatever the region's config: skipped code,
 * or plain code that is not the target.  Runs no Python. */
static inline int
code_state_passes(const CodeState *cs, PyObject *code, PyObject *target)
{
    return (cs->flags & CS_SKIP) || ((cs->flags & CS_PLAIN) && code != target);
}

#endif
