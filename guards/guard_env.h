/* guard_env.h - what guards/ takes from the rest of the extension: a few objects
 * set once at install time.  Besides this header, guards/ depends only on the
 * object-level half of the version layer (compat/compat_objects.h); nothing here
 * includes a header of csrc/, so the data flows one way: the shim (csrc/) calls
 * guards, guards never call back.
 *
 * All fields are strong references owned by this struct for the life of the
 * process; NULL until nnscaler_eval._C.install() has run (module.c fills them).
 */
#ifndef NNSCALER_GUARD_ENV_H
#define NNSCALER_GUARD_ENV_H

#include "compat_objects.h"

typedef struct {
    PyTypeObject *tensor_type;     /* torch._C.TensorBase */
    PyObject *is_grad_enabled;     /* torch.is_grad_enabled */
    /* interned names */
    PyObject *str_training, *str_dtype, *str_shape, *str_stride, *str_device,
        *str_requires_grad;
} GuardEnv;

extern GuardEnv guard_env;

#endif
