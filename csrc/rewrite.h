/* rewrite.h - the `self.training` conditional-expression rewrite, on bytecode.
 *
 *   x = a if self.training else b      ->  x = ifexpr(self.training, a, b)
 *   x = a if not self.training else b  ->  x = ifexpr(self.training, b, a)
 *
 * Rules (../shared/seeds/nnscaler-self-training-support.md): the condition is exactly
 * `self.training` (`self` a local or a cell), and neither branch holds a call; this
 * project also leaves alone branches that store or delete names (both branches are
 * evaluated after the rewrite, so a store would become unconditional).  Only
 * conditional expressions used as values are rewritten; one used directly as the
 * test of an `if`/`while`/`assert` compiles to jumps with no join and is left alone.
 * So is one whose value is discarded just before an exit the compiler adds (a bare
 * expression statement ending a function or a `finally` body): its join is copied
 * into the first branch, and the bytecode is that of an `if self.training:`
 * statement.  How sites are matched: the design note in rewrite.c.
 */
#ifndef NNSCALER_REWRITE_H
#define NNSCALER_REWRITE_H

#include "compat.h"

/* Cheap pre-filter: 0 when `code` cannot hold a qualifying site (no "training" in
 * co_names).  Never raises. */
int rewrite_may_apply(PyCodeObject *code);

/* Rewrite every qualifying site of `code`.
 *   ifexpr:   the callable placed in co_consts and called by the rewritten code
 *             (borrowed; TypeError when it is not callable).
 *   n_sites:  out, the number of sites rewritten.
 * Returns a NEW reference: a new code object when n_sites > 0, otherwise `code`
 * itself.  NULL with an exception set on failure (the caller then runs the original
 * code).  Line numbers, the exception table, argument/cell/free-variable order are
 * kept; co_stacksize is recomputed.  Does not run Python code other than
 * code.replace(). */
PyObject *rewrite_training_ifexpr(PyCodeObject *code, PyObject *ifexpr, int *n_sites);

#endif /* NNSCALER_REWRITE_H */
