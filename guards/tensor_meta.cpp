/* tensor_meta.cpp - see tensor_meta.h.  Built against the headers of the torch that
 * is installed at build time (setup.py); without them, NNS_NO_TORCH_HEADERS makes
 * every tensor take the Python path. */
#include "tensor_meta.h"

#ifndef NNS_NO_TORCH_HEADERS
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#endif

extern "C" int
nns_grad_mode(void)
{
#ifdef NNS_NO_TORCH_HEADERS
    return -1;
#else
    return at::GradMode::is_enabled() ? 1 : 0;
#endif
}

extern "C" int
nns_tensor_meta(PyObject *obj, NnsTensorMeta *meta)
{
#ifdef NNS_NO_TORCH_HEADERS
    (void)obj;
    (void)meta;
    return 0;
#else
    /* Null until torch._C has initialised (no tensor can exist before). */
    if (THPVariableClass == nullptr || !THPVariable_CheckTypeExact(Py_TYPE(obj))) {
        return 0;
    }
    try {
        const at::Tensor &t = THPVariable_Unpack(obj);
        if (!t.defined()) {
            return 0;
        }
        c10::TensorImpl *impl = t.unsafeGetTensorImpl();
        if (impl->layout() != c10::kStrided || impl->has_symbolic_sizes_strides()) {
            return 0;
        }
        const int64_t ndim = impl->dim();
        if (ndim > NNS_TENSOR_META_MAX_DIM) {
            return 0;
        }
        c10::IntArrayRef sizes = impl->sizes();
        c10::IntArrayRef strides = impl->strides();
        for (int64_t i = 0; i < ndim; i++) {
            meta->sizes[i] = sizes[i];
            meta->strides[i] = strides[i];
        }
        const c10::Device device = impl->device();
        meta->scalar_type = static_cast<int32_t>(impl->dtype().toScalarType());
        meta->device_type = static_cast<int16_t>(device.type());
        meta->device_index = static_cast<int16_t>(device.index());
        meta->requires_grad = impl->requires_grad() ? 1 : 0;
        meta->ndim = static_cast<int32_t>(ndim);
        return 1;
    }
    catch (...) {
        /* A tensor implementation that refuses (sizes of a nested or custom
         * tensor, ...): Python knows how to describe it. */
        return 0;
    }
#endif
}
