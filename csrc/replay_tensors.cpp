/* replay_tensors.cpp - see replay_tensors.h. */
#include "replay_tensors.h"

#include <exception>
#include <string>
#include <vector>

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

#ifdef NNS_NO_TORCH_HEADERS
/* `t[:n0, :n1, ...]` for the sizes of `like` (a tensor) or the tuple `sizes`,
 * through the tensor's own methods. */
static PyObject *
leading_view(PyObject *t, PyObject *sizes)
{
    PyObject *view = Py_NewRef(t);
    for (Py_ssize_t d = 0; view != NULL && d < PyTuple_GET_SIZE(sizes); d++) {
        Py_SETREF(view, PyObject_CallMethod(view, "narrow", "nnO", d, (Py_ssize_t)0,
                                            PyTuple_GET_ITEM(sizes, d)));
    }
    return view;
}
#else
/* `t[:n0, :n1, ...]` for `sizes`, refusing (ValueError naming `what`) a size larger
 * than t's or another number of dimensions. */
static bool
leading_view(const at::Tensor &t, c10::IntArrayRef sizes, const char *what, at::Tensor *out)
{
    if ((int64_t)sizes.size() != t.dim()) {
        PyErr_Format(PyExc_ValueError, "graph replay: %s has %zd dimensions, the recording's %zd",
                     what, (Py_ssize_t)sizes.size(), (Py_ssize_t)t.dim());
        return false;
    }
    at::Tensor view = t;
    for (int64_t d = 0; d < t.dim(); d++) {
        if (sizes[d] > t.sizes()[d] || sizes[d] < 0) {
            PyErr_Format(PyExc_ValueError, "graph replay: %s has size %lld in dimension %lld, "
                         "more than the recording's %lld", what, (long long)sizes[d],
                         (long long)d, (long long)t.sizes()[d]);
            return false;
        }
        if (sizes[d] != t.sizes()[d]) {
            view = view.narrow(d, 0, sizes[d]);
        }
    }
    *out = view;
    return true;
}
#endif

extern "C" int
nns_replay_copy(PyObject *dst, PyObject *src, const char *what, int prefix)
{
#ifdef NNS_NO_TORCH_HEADERS
    if (prefix) {
        PyObject *sizes = PyObject_GetAttrString(src, "shape");
        PyObject *view = sizes == NULL ? NULL : leading_view(dst, sizes);
        Py_XDECREF(sizes);
        if (view == NULL) {
            return -1;
        }
        int done = nns_replay_copy(view, src, what, 0);
        Py_DECREF(view);
        return done;
    }
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
        at::Tensor view = *target;
        if (target->sizes() != source->sizes() &&
            (!prefix || !leading_view(*target, source->sizes(), what, &view))) {
            if (!prefix) {
                PyErr_Format(PyExc_ValueError, "graph replay: %s has sizes %s, the "
                             "recording's %s", what, sizes_text(*source).c_str(),
                             sizes_text(*target).c_str());
            }
            return -1;
        }
        at::AutoGradMode no_grad(false);
        view.copy_(*source);
        return 0;
    }
    catch (const std::exception &e) {
        set_error(e);
        return -1;
    }
#endif
}

extern "C" PyObject *
nns_replay_clone(PyObject *t, PyObject *sizes)
{
#ifdef NNS_NO_TORCH_HEADERS
    PyObject *view = sizes == NULL ? Py_NewRef(t) : leading_view(t, sizes);
    PyObject *copy = view == NULL ? NULL : PyObject_CallMethod(view, "clone", NULL);
    Py_XDECREF(view);
    return copy;
#else
    const at::Tensor *tensor = unpack(t);
    if (tensor == nullptr) {
        return nullptr;
    }
    std::vector<int64_t> kept;
    if (sizes != NULL) {
        for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(sizes); d++) {
            kept.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, d)));
            if (kept.back() == -1 && PyErr_Occurred()) {
                return nullptr;
            }
        }
    }
    try {
        at::Tensor copy, view = *tensor;
        if (sizes != NULL && !leading_view(*tensor, kept, "an output", &view)) {
            return nullptr;
        }
        {
            at::AutoGradMode no_grad(false);
            copy = view.clone();
        }
        return THPVariable_Wrap(std::move(copy));
    }
    catch (const std::exception &e) {
        set_error(e);
        return nullptr;
    }
#endif
}
