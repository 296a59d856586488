/* recursion.c - the recursion budget of compiled calls (see recursion.h). */
#include "recursion.h"
#include "arming.h"

#include <stdint.h>
#if defined(__linux__)
#include <pthread.h>
#endif

/* More units than our own frames between a hand-over and a hand-back ever take
 * (measured: under 10 on every path); a larger difference means the depth handed
 * in is not the one this call pairs with, and nothing is credited. */
#define MAX_CREDIT 100

/* This thread's stack: lowest usable address and size; 0 until looked up, and
 * SIZE_MAX as size when it cannot be (then no credit is ever given). */
static _Thread_local uintptr_t stack_low;
static _Thread_local size_t stack_size;

static void
stack_lookup(void)
{
    stack_size = SIZE_MAX;
#if defined(__linux__)
    pthread_attr_t attr;
    void *addr;
    size_t size;
    if (pthread_getattr_np(pthread_self(), &attr) != 0) {
        return;
    }
    if (pthread_attr_getstack(&attr, &addr, &size) == 0 && size > 0) {
        stack_low = (uintptr_t)addr;
        stack_size = size;
    }
    pthread_attr_destroy(&attr);
#endif
}

/* Bytes left below the caller's frame, or -1 when unknown.  Stacks grow down on
 * every platform this builds for. */
static Py_ssize_t
stack_free(void)
{
    if (stack_size == 0) {
        stack_lookup();
    }
    if (stack_size == SIZE_MAX) {
        return -1;
    }
    char here;
    uintptr_t sp = (uintptr_t)&here;
    if (sp < stack_low || sp - stack_low > stack_size) {
        return -1;   /* not on the stack we looked up (a coroutine library's own) */
    }
    return (Py_ssize_t)(sp - stack_low);
}

/* Units credited on this thread now (the sum over the call_at_depth calls open on
 * its C stack): the units really on the stack are the counter's plus these. */
static _Thread_local long outstanding;

/* Bytes of stack kept free beyond the estimate, and the factor on the estimate. */
#define STACK_MARGIN (256 * 1024)
#define STACK_SAFETY 2.0
/* Least bytes a unit is assumed to take (frames run under a PEP 523 evaluator are
 * not inlined: each is a C-level call of the evaluator). */
#define MIN_UNIT_BYTES 256.0
/* Below this much free stack, call_at_depth raises RecursionError instead of
 * calling: at least a margin of frames' worth for the RecursionError's unwinding. */
#define STACK_FLOOR (128 * 1024)

/* May `credit` more units be given to this thread?  The recursion limit is also
 * what keeps the C stack from overflowing (3.11 has no other guard), and every
 * credited unit is one more frame on it.  So credit is given only while the stack
 * left is enough for all the units the thread could still use with it (up to the
 * limit), at the bytes per unit this thread's stack has cost so far, twice over
 * plus a margin.  Where the limit was set beyond what the stack holds, nothing is
 * credited and RecursionError comes at the plain count, as before. */
static int
stack_allows(PyThreadState *ts, long credit)
{
    Py_ssize_t free_bytes = stack_free();
    if (free_bytes < 0) {
        return 0;
    }
    double used_bytes = (double)(stack_size - (size_t)free_bytes);
    double used = (double)nns_recursion_used(ts);
    double units_on_stack = used + (double)outstanding;
    double per_unit = units_on_stack >= 1.0 ? used_bytes / units_on_stack : used_bytes;
    if (per_unit < MIN_UNIT_BYTES) {
        per_unit = MIN_UNIT_BYTES;
    }
    double still_usable = (double)Py_GetRecursionLimit() - used + (double)credit;
    return (double)free_bytes > still_usable * per_unit * STACK_SAFETY + STACK_MARGIN;
}

/* Is this thread armed (a capture, or code a capture runs), its frames going
 * through the evaluator?  An error reading it counts as not. */
static int
under_evaluator(void)
{
    PyObject *config, *target;
    if (arm_current(&config, &target) < 0) {
        PyErr_Clear();
        return 0;
    }
    return config != NULL;
}

PyObject *
recursion_depth(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(noargs))
{
    PyThreadState *ts = PyThreadState_Get();
    return PyLong_FromLong(nns_recursion_used(ts) - nns_recursion_builtin_call_units);
}

PyObject *
call_at_depth(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
              PyObject *kwnames)
{
    if (nargs < 2) {
        PyErr_SetString(PyExc_TypeError, "call_at_depth(depth, fn, /, *args, **kwargs)");
        return NULL;
    }
    long credit = 0;
    PyThreadState *ts = PyThreadState_Get();
    Py_ssize_t free_bytes = stack_free();
    if (free_bytes >= 0 && free_bytes < STACK_FLOOR && under_evaluator()) {
        /* Frames run under the evaluator are not inlined and cost more stack than
         * eager's: a limit set for eager can outlast the stack.  RecursionError
         * here, where nesting passes through, rather than a crash further in. */
        PyErr_SetString(PyExc_RecursionError,
                        "maximum recursion depth exceeded (C stack nearly exhausted)");
        return NULL;
    }
    if (args[0] != Py_None) {
        int overflow;
        long depth = PyLong_AsLongAndOverflow(args[0], &overflow);
        if (depth == -1 && PyErr_Occurred()) {
            return NULL;
        }
        credit = overflow ? 0 : (long)nns_recursion_used(ts) - depth;
        if (credit <= 0 || credit > MAX_CREDIT || !stack_allows(ts, credit)) {
            credit = 0;
        }
    }
    /* No Python runs between the credit and the call, or between the return and
     * the debit: whatever fn does (raise, get interrupted), the debit happens. */
    nns_recursion_credit(ts, (int)credit);
    outstanding += credit;
    PyObject *result = PyObject_Vectorcall(args[1], args + 2, (size_t)(nargs - 2), kwnames);
    outstanding -= credit;
    nns_recursion_credit(ts, -(int)credit);
    return result;
}

PyObject *
recursion_stack_room(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(noargs))
{
    Py_ssize_t free_bytes = stack_free();
    if (free_bytes < 0) {
        return Py_BuildValue("(nn)", (Py_ssize_t)-1, (Py_ssize_t)-1);
    }
    return Py_BuildValue("(nn)", free_bytes, (Py_ssize_t)stack_size);
}

/* ------------------------------------------------- a suspended trace's mode */

/* torch._C's mode-stack functions, looked up once (owned, for the process). */
static PyObject *stack_len, *stack_at, *stack_pop, *stack_push;

static int
mode_stack_functions(void)
{
    if (stack_push != NULL) {
        return 0;
    }
    PyObject *torch_c = PyImport_ImportModule("torch._C");
    if (torch_c == NULL) {
        return -1;
    }
    stack_len = PyObject_GetAttrString(torch_c, "_len_torch_function_stack");
    stack_at = stack_len ? PyObject_GetAttrString(torch_c, "_get_function_stack_at") : NULL;
    stack_pop = stack_at ? PyObject_GetAttrString(torch_c, "_pop_torch_function_stack") : NULL;
    stack_push = stack_pop ? PyObject_GetAttrString(torch_c, "_push_on_torch_function_stack")
                           : NULL;
    Py_DECREF(torch_c);
    if (stack_push == NULL) {
        Py_CLEAR(stack_len);
        Py_CLEAR(stack_at);
        Py_CLEAR(stack_pop);
        return -1;
    }
    return 0;
}

/* 1 when `mode` is the innermost torch function mode, 0 when not, -1 on error. */
static int
mode_on_top(PyObject *mode)
{
    PyObject *n = PyObject_CallNoArgs(stack_len);
    if (n == NULL) {
        return -1;
    }
    Py_ssize_t len = PyLong_AsSsize_t(n);
    Py_DECREF(n);
    if (len < 0) {
        return PyErr_Occurred() ? -1 : 0;
    }
    if (len == 0) {
        return 0;
    }
    PyObject *index = PyLong_FromSsize_t(len - 1);
    if (index == NULL) {
        return -1;
    }
    PyObject *top = PyObject_CallOneArg(stack_at, index);
    Py_DECREF(index);
    if (top == NULL) {
        return -1;
    }
    int same = top == mode;
    Py_DECREF(top);
    return same;
}

/* Pops `mode`, which the caller saw on top; pushes `stand_in` unless it is on top
 * now.  1 when stand_in was pushed, 0 when not, -1 on error (the stack as it was). */
static int
swap_in(PyObject *mode, PyObject *stand_in)
{
    PyObject *popped = PyObject_CallNoArgs(stack_pop);
    if (popped == NULL) {
        return -1;
    }
    Py_DECREF(popped);   /* `mode` itself: the caller holds it */
    int on_top = mode_on_top(stand_in);
    PyObject *pushed = on_top == 0 ? PyObject_CallOneArg(stack_push, stand_in) : NULL;
    if (pushed != NULL) {
        Py_DECREF(pushed);
        return 1;
    }
    if (on_top == 1) {
        return 0;
    }
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    pushed = PyObject_CallOneArg(stack_push, mode);
    Py_XDECREF(pushed);
    PyErr_Clear();
    PyErr_Restore(exc_type, exc_value, exc_tb);
    return -1;
}

/* Undoes swap_in; keeps a pending exception.  -1 (with an exception set, fn's
 * dropped) when `mode` could not be put back. */
static int
swap_out(PyObject *mode, PyObject *stand_in, int pushed_stand_in)
{
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    if (pushed_stand_in && mode_on_top(stand_in) == 1) {
        PyObject *popped = PyObject_CallNoArgs(stack_pop);
        Py_XDECREF(popped);
    }
    PyErr_Clear();
    PyObject *pushed = PyObject_CallOneArg(stack_push, mode);
    if (pushed == NULL) {
        Py_XDECREF(exc_type);
        Py_XDECREF(exc_value);
        Py_XDECREF(exc_tb);
        return -1;
    }
    Py_DECREF(pushed);
    PyErr_Restore(exc_type, exc_value, exc_tb);
    return 0;
}

PyObject *
call_with_mode_replaced(PyObject *Py_UNUSED(module), PyObject *const *args,
                        Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs < 3) {
        PyErr_SetString(PyExc_TypeError,
                        "call_with_mode_replaced(mode, stand_in, fn, /, *args, **kwargs)");
        return NULL;
    }
    PyObject *mode = args[0], *stand_in = args[1], *fn = args[2];
    int on_top;
    if (mode_stack_functions() < 0 || (on_top = mode_on_top(mode)) < 0) {
        return NULL;
    }
    if (!on_top) {
        return PyObject_Vectorcall(fn, args + 3, (size_t)(nargs - 3), kwnames);
    }
    /* Only torch's C functions run between the swap and the call and between the
     * return and the swap back: no bytecode, so no signal handler can interrupt
     * either, and `mode` is back on top whatever fn did (returned or raised). */
    Py_INCREF(mode);
    int pushed = swap_in(mode, stand_in);
    if (pushed < 0) {
        Py_DECREF(mode);
        return NULL;
    }
    PyObject *result = PyObject_Vectorcall(fn, args + 3, (size_t)(nargs - 3), kwnames);
    if (swap_out(mode, stand_in, pushed) < 0) {
        /* The trace would go on without seeing its ops: fail it loudly. */
        Py_CLEAR(result);
    }
    Py_DECREF(mode);
    return result;
}
