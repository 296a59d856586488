/* compiled_call.h - callables installed by nnscaler.compile().
 *
 * Calling either runs Python (the module's hooks check may call __bool__, the
 * attribute read of forward/_call_impl, and the call itself).  Each holds what it
 * uses across those (the module, the target, the function) by a strong
 * reference, and its config through the call region (arming.h), so deleting
 * the wrapper or the module from inside the call is safe.  Both are GC types: the
 * module <-> ModuleCall cycle is visible to the collector. */
#ifndef NNSCALER_COMPILED_CALL_H
#define NNSCALER_COMPILED_CALL_H

#include "compat.h"

extern PyTypeObject ModuleCall_Type;
extern PyTypeObject CompiledFunction_Type;

#endif
