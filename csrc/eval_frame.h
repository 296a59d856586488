/* eval_frame.h - the PEP 523 hook: the evaluator CPython calls for every frame
 * while some region is armed (arming.h installs and uninstalls it).
 *
 * Only module.c includes this header: the hook calls into arming, frame_calls and
 * dispatch, and nothing calls back into the hook but CPython.
 */
#ifndef NNSCALER_EVAL_FRAME_H
#define NNSCALER_EVAL_FRAME_H

#include "compat.h"

/* Module init: readies arming (arming_init) with this file's evaluator as the hook
 * that opening the first armed region installs.  0, or -1 with an exception set.
 * Runs no Python code. */
int eval_frame_init(PyObject *module);

#endif
