/* call_key_format.h - the bytes of a per-call key (call_key.h): the tags that start
 * each record and the forms a record takes.  Written by the encoder (call_key.c),
 * read by the one reader of these bytes (call_key_reader.c); nothing else looks
 * inside a key but to compare it (cache.c) or at the offsets the reader reports
 * (shape_guards.h).  Definitions only.
 */
#ifndef NNSCALER_CALL_KEY_FORMAT_H
#define NNSCALER_CALL_KEY_FORMAT_H

#include <stddef.h>

#include "tensor_meta.h"

/* A TAG_TENSOR_META record copies NnsTensorMeta's fixed fields as bytes: no padding
 * allowed. */
_Static_assert(offsetof(NnsTensorMeta, sizes) == 16, "NnsTensorMeta has padding");

enum {
    TAG_NONE = 1, TAG_FALSE, TAG_TRUE, TAG_INT, TAG_BIGINT, TAG_FLOAT, TAG_STR,
    TAG_TUPLE, TAG_LIST, TAG_DICT, TAG_TENSOR, TAG_OBJECT, TAG_GRAD,
    TAG_ALIAS,        /* a tensor seen earlier in this key: its index follows */
    TAG_SUBTYPE,      /* a subclass of tuple/int/float/str: its type, then the value */
    TAG_BUFFER,       /* a NumPy scalar: its type, then its bytes */
    TAG_DEVICE,       /* a torch.device (put_device) */
    TAG_TENSOR_META,  /* a plain tensor read in C++ (tensor_meta.h): type, fixed
                         fields, sizes, strides */
    TAG_UNTRACKED,    /* the tensor that follows is past CALL_KEY_MAX_ALIAS: alias
                         detection is off from there */
    TAG_STRUCT,       /* an object of a structured type (call_key_set_struct_types):
                         its type, then its instance __dict__ as a TAG_DICT */
    TAG_SHARED,       /* a structured object, or a list or dict inside one, met
                         earlier in this key: its index among them follows */
};

/* How the Python path (TAG_TENSOR) records a tensor's dtype, and how it and TAG_DEVICE
 * record a device: the first byte says which form follows. */
enum {
    DTYPE_SCALAR_TYPE = 0,   /* int32 c10::ScalarType of a torch.dtype */
    DTYPE_OBJECT,            /* something else (or no torch headers): its address, pinned */
};
enum {
    DEVICE_PARTS = 0,        /* int16 c10::DeviceType, int16 c10::DeviceIndex */
    DEVICE_HASH,             /* no torch headers: the torch.device's hash, which is
                                injective on (type, index) */
};

#endif /* NNSCALER_CALL_KEY_FORMAT_H */
