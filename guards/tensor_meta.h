/* tensor_meta.h - what the call key needs of a tensor, read from the C++ tensor.
 *
 * The one place that knows PyTorch's C++ types (tensor_meta.cpp): a plain
 * torch.Tensor or nn.Parameter is read without building a Python object (dtype,
 * device, torch.Size and the stride tuple cost about 4,000 instructions per tensor
 * through attribute access; this about 60).  Everything else, tensor subclasses
 * included (their attributes may be Python), goes through Python in call_key.c.
 */
#ifndef NNSCALER_TENSOR_META_H
#define NNSCALER_TENSOR_META_H

#include <Python.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NNS_TENSOR_META_MAX_DIM 16

typedef struct {
    int32_t scalar_type;      /* c10::ScalarType */
    int16_t device_type;      /* c10::DeviceType */
    int16_t device_index;
    int32_t requires_grad;
    int32_t ndim;
    int64_t sizes[NNS_TENSOR_META_MAX_DIM];
    int64_t strides[NNS_TENSOR_META_MAX_DIM];
} NnsTensorMeta;

/* The key's record of a tensor that is exactly a torch.Tensor or nn.Parameter with
 * strided layout, concrete sizes and at most NNS_TENSOR_META_MAX_DIM dimensions
 * (anything else is read through Python in call_key.c), written straight into `out`:
 * NnsTensorMeta's fixed fields (up to `sizes`), then ndim sizes and ndim strides,
 * int64 each, unaligned.  `out` has room for NNS_TENSOR_RECORD_MAX bytes.  Returns the
 * bytes written, or 0 when `obj` is not such a tensor (`out` then holds nothing
 * meaningful).  Runs no Python, never raises. */
#define NNS_TENSOR_RECORD_MAX (16 + 2 * 8 * NNS_TENSOR_META_MAX_DIM)
size_t nns_tensor_record(PyObject *obj, unsigned char *out);
/* The same for an `obj` whose type the caller found to be exactly torch.Tensor or
 * nn.Parameter (nns_tensor_classes). */
size_t nns_tensor_record_exact(PyObject *obj, unsigned char *out);

/* torch's grad mode on this thread (at::GradMode): 1 or 0, or -1 when this build
 * has no torch headers (the caller asks torch.is_grad_enabled()).  Runs no Python,
 * never raises. */
int nns_grad_mode(void);

/* torch.Tensor and nn.Parameter (the two classes whose instances nns_tensor_record
 * reads; torch keeps both for the life of the process): 1 with both set once
 * torch._C has initialised, else 0 (always 0 without torch's headers).  Never
 * raises. */
int nns_tensor_classes(PyTypeObject **tensor, PyTypeObject **parameter);

/* The c10::ScalarType of a torch.dtype object, or -1 when `obj` is not one (or the
 * build has no torch headers).  Runs no Python, never raises. */
int32_t nns_dtype_scalar_type(PyObject *obj);

/* 1 with *type and *index set (c10::DeviceType, c10::DeviceIndex) when `obj` is a
 * torch.device; 0 otherwise (or without torch headers).  Runs no Python, never raises. */
int nns_device_parts(PyObject *obj, int16_t *type, int16_t *index);

/* For describing a key (call_key_describe): the name torch gives a scalar type
 * ("float32"), or NULL; a device as torch prints it ("cpu", "cuda:0") into `buf`, 1 on
 * success, 0 when the pair is not a device torch knows.  Run no Python, never raise. */
const char *nns_scalar_type_name(int32_t scalar_type);
int nns_device_name(int16_t type, int16_t index, char *buf, size_t size);

#ifdef __cplusplus
}
#endif

#endif
