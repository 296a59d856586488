/* tensor_meta.cpp - see tensor_meta.h.  Built against the headers of the torch that
 * is installed at build time (setup.py); without them, NNS_NO_TORCH_HEADERS makes
 * every tensor take the Python path. */
#include "tensor_meta.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

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

#ifndef NNS_NO_TORCH_HEADERS
/* Tensors of up to kShortDims dimensions have their sizes and strides copied as
 * fixed blocks of kShortDims words each.  Only where both arrays are the
 * TensorImpl's own inline storage (SizesAndStrides holds
 * C10_SIZES_AND_STRIDES_MAX_INLINE_SIZE sizes, then as many strides, inside the
 * object): then every word read is the object's own memory.  Anything else (sizes kept out of line, a
 * TensorImpl subclass answering sizes() from elsewhere) copies exactly ndim. */
static constexpr int64_t kShortDims = 4;
static_assert(kShortDims <= C10_SIZES_AND_STRIDES_MAX_INLINE_SIZE, "inline storage is shorter");
static_assert(16 + 2 * 8 * kShortDims <= NNS_TENSOR_RECORD_MAX, "record room");

/* Both arrays are the inline storage of a SizesAndStrides inside `impl`: the
 * strides follow the sizes there, and the whole storage lies within the object. */
static inline bool
stored_inline(const c10::TensorImpl *impl, const int64_t *sizes, const int64_t *strides)
{
    constexpr uintptr_t span = 8 * 2 * C10_SIZES_AND_STRIDES_MAX_INLINE_SIZE;
    static_assert(sizeof(c10::TensorImpl) >= span, "TensorImpl holds its inline sizes");
    const uintptr_t offset = reinterpret_cast<uintptr_t>(sizes) - reinterpret_cast<uintptr_t>(impl);
    return strides == sizes + C10_SIZES_AND_STRIDES_MAX_INLINE_SIZE &&
           offset <= sizeof(c10::TensorImpl) - span;   /* unsigned: below impl wraps */
}
#endif

extern "C" size_t
nns_tensor_record(PyObject *obj, unsigned char *out)
{
    PyTypeObject *tensor, *parameter;   /* none without torch's headers */
    if (!nns_tensor_classes(&tensor, &parameter) ||
        (!Py_IS_TYPE(obj, tensor) && !Py_IS_TYPE(obj, parameter))) {
        return 0;
    }
    return nns_tensor_record_exact(obj, out);
}

extern "C" size_t
nns_tensor_record_exact(PyObject *obj, unsigned char *out)
{
#ifdef NNS_NO_TORCH_HEADERS
    (void)obj;
    (void)out;
    return 0;
#else
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
        constexpr size_t head = offsetof(NnsTensorMeta, sizes);
        static_assert(head == 16, "NnsTensorMeta's fixed fields have padding");
        const c10::Device device = impl->device();
        NnsTensorMeta fixed;
        fixed.scalar_type = static_cast<int32_t>(impl->dtype().toScalarType());
        fixed.device_type = static_cast<int16_t>(device.type());
        fixed.device_index = static_cast<int16_t>(device.index());
        fixed.requires_grad = impl->requires_grad() ? 1 : 0;
        fixed.ndim = static_cast<int32_t>(ndim);
        std::memcpy(out, &fixed, head);
        unsigned char *p = out + head;
        const size_t span = 8 * static_cast<size_t>(ndim);
        const int64_t *sizes = impl->sizes().data();
        const int64_t *strides = impl->strides().data();
        if (ndim <= kShortDims && stored_inline(impl, sizes, strides)) {
            /* Fixed-size copies (no loop, no library call): kShortDims words of
             * sizes, then as many of strides at the end of the sizes, over the
             * sizes' tail.  What lies past the record is not part of it (`out` has
             * room for NNS_TENSOR_RECORD_MAX bytes). */
            std::memcpy(p, sizes, 8 * kShortDims);
            std::memcpy(p + span, strides, 8 * kShortDims);
        }
        else {
            for (int64_t i = 0; i < ndim; i++) {
                std::memcpy(p + 8 * i, sizes + i, 8);
                std::memcpy(p + span + 8 * i, strides + i, 8);
            }
        }
        return head + 2 * span;
    }
    catch (...) {
        return 0;
    }
#endif
}

extern "C" int
nns_tensor_classes(PyTypeObject **tensor, PyTypeObject **parameter)
{
#ifdef NNS_NO_TORCH_HEADERS
    *tensor = *parameter = nullptr;
    return 0;
#else
    if (THPVariableClass == nullptr || ParameterClass == nullptr) {
        return 0;
    }
    *tensor = reinterpret_cast<PyTypeObject *>(THPVariableClass);
    *parameter = reinterpret_cast<PyTypeObject *>(ParameterClass);
    return 1;
#endif
}

#ifndef NNS_NO_TORCH_HEADERS
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Dtype.h>
#include <cstring>
#endif

extern "C" int32_t
nns_dtype_scalar_type(PyObject *obj)
{
#ifdef NNS_NO_TORCH_HEADERS
    (void)obj;
    return -1;
#else
    if (!THPDtype_Check(obj)) {
        return -1;
    }
    return static_cast<int32_t>(reinterpret_cast<THPDtype *>(obj)->scalar_type);
#endif
}

extern "C" int
nns_device_parts(PyObject *obj, int16_t *type, int16_t *index)
{
#ifdef NNS_NO_TORCH_HEADERS
    (void)obj;
    (void)type;
    (void)index;
    return 0;
#else
    if (!THPDevice_Check(obj)) {
        return 0;
    }
    const c10::Device &device = reinterpret_cast<THPDevice *>(obj)->device;
    *type = static_cast<int16_t>(device.type());
    *index = static_cast<int16_t>(device.index());
    return 1;
#endif
}

extern "C" const char *
nns_scalar_type_name(int32_t scalar_type)
{
#ifdef NNS_NO_TORCH_HEADERS
    (void)scalar_type;
    return nullptr;
#else
    if (scalar_type < 0 || scalar_type >= static_cast<int32_t>(c10::ScalarType::NumOptions)) {
        return nullptr;
    }
    try {
        /* torch's own dtype objects live as long as the process: their name too */
        THPDtype *dtype = torch::getTHPDtype(static_cast<c10::ScalarType>(scalar_type));
        return dtype != nullptr ? dtype->name : nullptr;
    }
    catch (...) {
        return nullptr;
    }
#endif
}

extern "C" int
nns_device_name(int16_t type, int16_t index, char *buf, size_t size)
{
#ifdef NNS_NO_TORCH_HEADERS
    (void)type;
    (void)index;
    (void)buf;
    (void)size;
    return 0;
#else
    if (size == 0 || type < 0 ||
        type >= static_cast<int16_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)) {
        return 0;
    }
    try {
        const std::string name = c10::Device(static_cast<c10::DeviceType>(type),
                                              static_cast<c10::DeviceIndex>(index)).str();
        std::strncpy(buf, name.c_str(), size - 1);
        buf[size - 1] = '\0';
        return 1;
    }
    catch (...) {
        return 0;
    }
#endif
}
