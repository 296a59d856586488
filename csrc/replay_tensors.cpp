/* replay_tensors.cpp - see replay_tensors.h. */
#include "replay_tensors.h"

#include <exception>
#include <string>

#include "tensor_meta.h"

#ifndef NNS_NO_TORCH_HEADERS
#include <ATen/core/grad_mode.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/python_variable.h>

/* The C++ tensor of `obj`, a plain torch.Tensor or nn.Parameter; nullptr with
 * TypeError otherwise. */
static const at::Tensor *
unpack(PyObject *obj)
{
    PyTypeObject *tensor, *parameter;
    if (!nns_tensor_classes(&tensor, &parameter) ||
        (!Py_IS_TYPE(obj, tensor) && !Py_IS_TYPE(obj, parameter))) {
        PyErr_Format(PyExc_TypeError, "a graph replay takes torch.Tensor arguments, not %.200s",
                     Py_TYPE(obj)->tp_name);
        return nullptr;
    }
    return &THPVariable_Unpack(obj);
}

static void
set_error(const std::exception &e)
{
    /* torch's errors without the C++ backtrace, as torch's Python bindings show them */
    const auto *torch_error = dynamic_cast<const c10::Error *>(&e);
    PyErr_SetString(PyExc_RuntimeError,
                    torch_error != nullptr ? torch_error->what_without_backtrace() : e.what());
}

static std::string
sizes_text(const at::Tensor &t)
{
    std::string text = "[";
    for (int64_t i = 0; i < t.dim(); i++) {
        text += (i ? ", " : "") + std::to_string(t.sizes()[i]);
    }
    return text + "]";
}

#endif

extern "C" int
nns_replay_same_memory(PyObject *a, PyObject *b)
{
#ifdef NNS_NO_TORCH_HEADERS
    int same = 0;
    PyObject *pa = PyObject_CallMethod(a, "data_ptr", NULL);
    PyObject *pb = pa == NULL ? NULL : PyObject_CallMethod(b, "data_ptr", NULL);
    if (pb == NULL) {
        Py_XDECREF(pa);
        return -1;
    }
    same = PyObject_RichCompareBool(pa, pb, Py_EQ);
    Py_DECREF(pa);
    Py_DECREF(pb);
    if (same != 1) {
        return same;
    }
    static const char *const fields[] = {"shape", "stride", "dtype", "device"};
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]) && same == 1; i++) {
        PyObject *fa = PyObject_GetAttrString(a, fields[i]);
        PyObject *fb = fa == NULL ? NULL : PyObject_GetAttrString(b, fields[i]);
        if (fb != NULL && PyCallable_Check(fa)) {   /* stride() is a method */
            Py_SETREF(fa, PyObject_CallNoArgs(fa));
            Py_SETREF(fb, fa == NULL ? NULL : PyObject_CallNoArgs(fb));
        }
        same = fb == NULL ? -1 : PyObject_RichCompareBool(fa, fb, Py_EQ);
        Py_XDECREF(fa);
        Py_XDECREF(fb);
    }
    return same;
#else
    const at::Tensor *first = unpack(a);
    const at::Tensor *second = first == nullptr ? nullptr : unpack(b);
    if (second == nullptr) {
        return -1;
    }
    try {
        if (!first->has_storage() || !second->has_storage() || first->is_meta() || second->is_meta()) {
            PyErr_SetString(PyExc_ValueError, "a graph replay needs tensors with memory "
                                              "(not meta or fake tensors)");
            return -1;
        }
        return first->const_data_ptr() == second->const_data_ptr() && first->sizes() == second->sizes() &&
               first->strides() == second->strides() && first->dtype() == second->dtype() &&
               first->device() == second->device();
    }
    catch (const std::exception &e) {
        set_error(e);
        return -1;
    }
#endif
}

extern "C" int
nns_replay_copy(PyObject *dst, PyObject *src, const char *what)
{
#ifdef NNS_NO_TORCH_HEADERS
    PyObject *ds = PyObject_GetAttrString(dst, "shape");
    PyObject *ss = ds == NULL ? NULL : PyObject_GetAttrString(src, "shape");
    int equal = ss == NULL ? -1 : PyObject_RichCompareBool(ds, ss, Py_EQ);
    if (equal == 0) {
        PyErr_Format(PyExc_ValueError, "graph replay: %s has sizes %R, the recording's %R",
                     what, ss, ds);
    }
    Py_XDECREF(ds);
    Py_XDECREF(ss);
    if (equal != 1) {
        return -1;
    }
    /* detached: the buffer never joins the caller's autograd graph */
    PyObject *detached = PyObject_CallMethod(src, "detach", NULL);
    PyObject *done = detached == NULL ? NULL : PyObject_CallMethod(dst, "copy_", "O", detached);
    Py_XDECREF(detached);
    if (done == NULL) {
        return -1;
    }
    Py_DECREF(done);
    return 0;
#else
    const at::Tensor *target = unpack(dst);
    const at::Tensor *source = target == nullptr ? nullptr : unpack(src);
    if (source == nullptr) {
        return -1;
    }
    try {
        if (target->sizes() != source->sizes()) {
            PyErr_Format(PyExc_ValueError, "graph replay: %s has sizes %s, the recording's %s",
                         what, sizes_text(*source).c_str(), sizes_text(*target).c_str());
            return -1;
        }
        at::AutoGradMode no_grad(false);
        const_cast<at::Tensor *>(target)->copy_(*source);
        return 0;
    }
    catch (const std::exception &e) {
        set_error(e);
        return -1;
    }
#endif
}

extern "C" PyObject *
nns_replay_clone(PyObject *t)
{
#ifdef NNS_NO_TORCH_HEADERS
    return PyObject_CallMethod(t, "clone", NULL);
#else
    const at::Tensor *tensor = unpack(t);
    if (tensor == nullptr) {
        return nullptr;
    }
    try {
        at::Tensor copy;
        {
            at::AutoGradMode no_grad(false);
            copy = tensor->clone();
        }
        return THPVariable_Wrap(std::move(copy));
    }
    catch (const std::exception &e) {
        set_error(e);
        return nullptr;
    }
#endif
}

extern "C" PyObject *
nns_replay_leading(PyObject *t, PyObject *sizes, const char *what)
{
#ifdef NNS_NO_TORCH_HEADERS
    PyObject *view = Py_NewRef(t);
    for (Py_ssize_t d = 0; view != NULL && d < PyTuple_GET_SIZE(sizes); d++) {
        Py_SETREF(view, PyObject_CallMethod(view, "narrow", "nnO", d, (Py_ssize_t)0,
                                            PyTuple_GET_ITEM(sizes, d)));
    }
    (void)what;
    return view;
#else
    const at::Tensor *tensor = unpack(t);
    if (tensor == nullptr) {
        return nullptr;
    }
    if (PyTuple_GET_SIZE(sizes) != tensor->dim()) {
        PyErr_Format(PyExc_ValueError, "graph replay: %s has %zd dimensions, the recording's %zd",
                     what, PyTuple_GET_SIZE(sizes), (Py_ssize_t)tensor->dim());
        return nullptr;
    }
    try {
        at::Tensor view = *tensor;
        for (int64_t d = 0; d < tensor->dim(); d++) {
            long long n = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, d));
            if (n == -1 && PyErr_Occurred()) {
                return nullptr;
            }
            if (n < 0 || n > tensor->sizes()[d]) {
                PyErr_Format(PyExc_ValueError, "graph replay: %s has size %lld in dimension "
                             "%lld, more than the recording's %lld", what, n, (long long)d,
                             (long long)tensor->sizes()[d]);
                return nullptr;
            }
            if (n != tensor->sizes()[d]) {
                view = view.narrow(d, 0, n);
            }
        }
        return THPVariable_Wrap(std::move(view));
    }
    catch (const std::exception &e) {
        set_error(e);
        return nullptr;
    }
#endif
}
