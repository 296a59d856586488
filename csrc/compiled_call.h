/* compiled_call.h - callables installed by nnscaler.compile(). */
#ifndef NNSCALER_COMPILED_CALL_H
#define NNSCALER_COMPILED_CALL_H

#include "compat.h"

extern PyTypeObject ModuleCall_Type;
extern PyTypeObject CompiledFunction_Type;

#endif
