/* bytecode.c - decode a code object into an instruction list and assemble it back.
 *
 * Design notes
 * - Jump targets are instruction indices while a pass edits the list; byte offsets
 *   exist only inside bytecode_assemble(), which recomputes them until the number of
 *   EXTENDED_ARG prefixes of every jump stops growing.  Sizes only ever grow, so the
 *   loop ends; a prefix may then be one longer than strictly needed, which CPython
 *   accepts (EXTENDED_ARG 0 is harmless).
 * - A relative jump counts from the end of the jumping instruction, inline caches
 *   included (3.11 jumps have no caches; 3.12's FOR_ITER and 3.13's conditional jumps
 *   do, and count from after them).
 * - An instruction's location and handler are those of its opcode code unit: that is
 *   the unit the interpreter reports (frame.f_lasti) and looks up in both tables.  On
 *   the way back the whole instruction (prefixes, opcode, caches) gets them, which is
 *   what the compiler writes.
 * - Location table (Objects/locations.md in CPython's documentation of the format):
 *   entries of 1-8 code units; the first byte is 0x80 | code << 3 | (units - 1).
 *   Varints there are 6-bit groups, least significant first, 0x40 = more.  We write
 *   the compact forms where they fit, the long form (code 14) otherwise, and code 15
 *   for "no location".
 * - Exception table (Objects/exception_handling_notes.txt): entries of four varints
 *   (start, size, target in code units, depth << 1 | lasti); here the 6-bit groups
 *   come most significant first, 0x40 = more, and 0x80 marks an entry's first byte.
 */
#include "bytecode.h"

#include <limits.h>
#include <stdarg.h>

/* The oparg of one instruction holds at most 4 bytes: 3 EXTENDED_ARG prefixes. */
#define MAX_EXTENDED_ARGS 3
/* Far above anything a compiler emits; a bound for malformed code. */
#define MAX_STACK_DEPTH (1 << 24)

int
bytecode_code_error(PyCodeObject *code, PyObject *exc_type, const char *format, ...)
{
    PyObject *message = NULL;
    va_list vargs;

    va_start(vargs, format);
    message = PyUnicode_FromFormatV(format, vargs);
    va_end(vargs);
    if (message != NULL) {
        PyErr_Format(exc_type, "%U (in %U at %U:%d)", message, code->co_qualname,
                     code->co_filename, code->co_firstlineno);
        Py_DECREF(message);
    }
    return -1;
}

/* Replace the exception being raised with a ValueError that names the code, the
 * original as its __cause__.  Not for MemoryError, which stays as it is. */
static void
raise_from_current(PyCodeObject *code, const char *what)
{
    PyObject *type, *value, *traceback;

    if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
        return;
    }
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    bytecode_code_error(code, PyExc_ValueError, "%s: %S", what, value);
    if (value != NULL) {
        PyObject *new_type, *new_value, *new_traceback;
        PyErr_Fetch(&new_type, &new_value, &new_traceback);
        PyErr_NormalizeException(&new_type, &new_value, &new_traceback);
        if (new_value != NULL) {
            if (traceback != NULL) {
                PyException_SetTraceback(value, traceback);
            }
            PyException_SetCause(new_value, Py_NewRef(value));  /* steals */
        }
        PyErr_Restore(new_type, new_value, new_traceback);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
}

void
bytecode_list_clear(NnsInstrList *list)
{
    PyMem_Free(list->items);
    list->items = NULL;
    list->n = 0;
    list->cap = 0;
}

int
bytecode_list_append(NnsInstrList *list, const NnsInstr *instr)
{
    if (list->n == list->cap) {
        if (list->cap > INT_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        int cap = list->cap ? list->cap * 2 : 64;
        NnsInstr *items = PyMem_Realloc(list->items, (size_t)cap * sizeof(NnsInstr));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        list->items = items;
        list->cap = cap;
    }
    list->items[list->n++] = *instr;
    return 0;
}

int
bytecode_resolve_jumps(const NnsInstrList *list, int index)
{
    /* A chain longer than the list must revisit an instruction: a jump loop. */
    for (int steps = 0; steps <= list->n; steps++) {
        const NnsInstr *instr = &list->items[index];
        int unconditional;
        if (nns_opcode_jump_kind(instr->opcode, &unconditional) == 0 || !unconditional) {
            return index;
        }
        index = instr->target;
    }
    return -1;
}

static int
cache_units(int opcode)
{
    return nns_opcodes.cache_entries[opcode & 0xFF];
}

/* ---------------------------------------------------------------- reading tables */

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
} ByteReader;

static int
read_byte(ByteReader *r, unsigned int *out)
{
    if (r->p >= r->end) {
        return -1;
    }
    *out = *r->p++;
    return 0;
}

/* Location-table varint: 6-bit groups, least significant first. */
static int
read_varint_lsb_first(ByteReader *r, unsigned int *out)
{
    unsigned int byte, value, shift = 0;
    if (read_byte(r, &byte) < 0) {
        return -1;
    }
    value = byte & 63;
    while (byte & 64) {
        shift += 6;
        if (shift > 30 || read_byte(r, &byte) < 0) {
            return -1;
        }
        value |= (byte & 63) << shift;
    }
    *out = value;
    return 0;
}

static int
read_signed_varint(ByteReader *r, int *out)
{
    unsigned int value;
    if (read_varint_lsb_first(r, &value) < 0) {
        return -1;
    }
    *out = (value & 1) ? -(int)(value >> 1) : (int)(value >> 1);
    return 0;
}

/* Exception-table varint: 6-bit groups, most significant first. */
static int
read_varint_msb_first(ByteReader *r, unsigned int *out, int *entry_start)
{
    unsigned int byte, value;
    if (read_byte(r, &byte) < 0) {
        return -1;
    }
    if (entry_start != NULL) {
        *entry_start = (byte & 0x80) != 0;
    }
    value = byte & 63;
    while (byte & 64) {
        if (value > (INT_MAX >> 6) || read_byte(r, &byte) < 0) {
            return -1;
        }
        value = (value << 6) | (byte & 63);
    }
    *out = value;
    return 0;
}

/* Index of the first instruction whose opcode unit is >= unit. */
static int
first_instr_at_or_after(const int *op_units, int n_instrs, int unit)
{
    int lo = 0, hi = n_instrs;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (op_units[mid] < unit) {
            lo = mid + 1;
        }
        else {
            hi = mid;
        }
    }
    return lo;
}

static int
decode_locations(PyCodeObject *code, NnsInstrList *list, const int *op_units)
{
    PyObject *table = code->co_linetable;
    ByteReader r = {(const unsigned char *)PyBytes_AS_STRING(table),
                    (const unsigned char *)PyBytes_AS_STRING(table) + PyBytes_GET_SIZE(table)};
    int line = code->co_firstlineno;
    int unit = 0;
    int k = 0;

    while (r.p < r.end && k < list->n) {
        unsigned int first, a, b, c;
        int delta;
        NnsLocation loc = {0, 0, 0, -1, -1};
        if (read_byte(&r, &first) < 0 || !(first & 0x80)) {
            goto corrupt;
        }
        int form = (first >> 3) & 15;
        int units = (int)(first & 7) + 1;
        switch (form) {
        case 15:    /* no location */
            break;
        case 14:    /* long form */
            if (read_signed_varint(&r, &delta) < 0 || read_varint_lsb_first(&r, &a) < 0
                || read_varint_lsb_first(&r, &b) < 0 || read_varint_lsb_first(&r, &c) < 0) {
                goto corrupt;
            }
            line += delta;
            loc = (NnsLocation){1, line, line + (int)a, (int)b - 1, (int)c - 1};
            break;
        case 13:    /* line only, no columns */
            if (read_signed_varint(&r, &delta) < 0) {
                goto corrupt;
            }
            line += delta;
            loc = (NnsLocation){1, line, line, -1, -1};
            break;
        case 10:
        case 11:
        case 12:    /* one line, line delta 0-2, byte-sized columns */
            if (read_byte(&r, &a) < 0 || read_byte(&r, &b) < 0) {
                goto corrupt;
            }
            line += form - 10;
            loc = (NnsLocation){1, line, line, (int)a, (int)b};
            break;
        default:    /* short form: same line, small columns */
            if (read_byte(&r, &a) < 0) {
                goto corrupt;
            }
            loc = (NnsLocation){1, line, line, form * 8 + (int)((a >> 4) & 7),
                                form * 8 + (int)((a >> 4) & 7) + (int)(a & 15)};
            break;
        }
        for (; k < list->n && op_units[k] < unit + units; k++) {
            list->items[k].loc = loc;
        }
        unit += units;
    }
    return 0;

corrupt:
    return bytecode_code_error(code, PyExc_ValueError, "corrupt co_linetable");
}

static int
decode_exception_table(PyCodeObject *code, NnsInstrList *list, const int *op_units,
                       const int *unit_instr, int n_units)
{
    PyObject *table = code->co_exceptiontable;
    ByteReader r = {(const unsigned char *)PyBytes_AS_STRING(table),
                    (const unsigned char *)PyBytes_AS_STRING(table) + PyBytes_GET_SIZE(table)};

    while (r.p < r.end) {
        unsigned int start, size, target, depth_lasti;
        int entry_start;
        if (read_varint_msb_first(&r, &start, &entry_start) < 0 || !entry_start
            || read_varint_msb_first(&r, &size, NULL) < 0
            || read_varint_msb_first(&r, &target, NULL) < 0
            || read_varint_msb_first(&r, &depth_lasti, NULL) < 0) {
            return bytecode_code_error(code, PyExc_ValueError, "corrupt co_exceptiontable");
        }
        if (start > (unsigned int)n_units || size > (unsigned int)n_units - start
            || target >= (unsigned int)n_units || unit_instr[target] < 0) {
            return bytecode_code_error(code, PyExc_ValueError,
                                       "exception table entry [%u, %u) -> %u does not fit "
                                       "the bytecode", start, start + size, target);
        }
        NnsHandler handler = {unit_instr[target], (int)(depth_lasti >> 1),
                              (int)(depth_lasti & 1)};
        for (int k = first_instr_at_or_after(op_units, list->n, (int)start);
             k < list->n && op_units[k] < (int)(start + size); k++) {
            list->items[k].handler = handler;
        }
    }
    return 0;
}

int
bytecode_decode(PyCodeObject *code, NnsInstrList *out)
{
    int ret = -1;
    /* owned */
    PyObject *co_code = NULL;
    int *unit_instr = NULL;     /* code unit -> instruction starting there, or -1 */
    int *op_units = NULL;       /* instruction -> code unit of its opcode */

    co_code = PyCode_GetCode(code);
    if (co_code == NULL) {
        goto done;
    }
    const unsigned char *bytes = (const unsigned char *)PyBytes_AS_STRING(co_code);
    Py_ssize_t size = PyBytes_GET_SIZE(co_code);
    if (size % 2 != 0 || size / 2 >= INT_MAX / 2) {
        bytecode_code_error(code, PyExc_ValueError, "co_code has an unusable size");
        goto done;
    }
    int n_units = (int)(size / 2);
    unit_instr = PyMem_Malloc(((size_t)n_units + 1) * sizeof(int));
    op_units = PyMem_Malloc(((size_t)n_units + 1) * sizeof(int));
    if (unit_instr == NULL || op_units == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int u = 0; u <= n_units; u++) {
        unit_instr[u] = -1;
    }

    for (int u = 0; u < n_units;) {
        int start = u;
        unsigned int oparg = 0;
        int n_prefixes = 0;
        while (u < n_units && bytes[2 * u] == nns_opcodes.op_extended_arg) {
            oparg = (oparg | bytes[2 * u + 1]) << 8;
            u++;
            n_prefixes++;
        }
        if (u >= n_units || n_prefixes > MAX_EXTENDED_ARGS) {
            bytecode_code_error(code, PyExc_ValueError,
                                "unusable EXTENDED_ARG prefix at offset %d", 2 * start);
            goto done;
        }
        oparg |= bytes[2 * u + 1];
        int opcode = bytes[2 * u];
        if (opcode == nns_opcodes.op_cache || oparg > INT_MAX
            || u + 1 + cache_units(opcode) > n_units) {
            bytecode_code_error(code, PyExc_ValueError,
                                "unusable instruction at offset %d", 2 * u);
            goto done;
        }
        NnsInstr instr = {.opcode = opcode, .oparg = (int)oparg, .target = -1,
                          .flags = 0, .loc = {0, 0, 0, -1, -1}, .handler = {-1, 0, 0}};
        unit_instr[start] = out->n;
        op_units[out->n] = u;
        if (bytecode_list_append(out, &instr) < 0) {
            goto done;
        }
        u += 1 + cache_units(opcode);
    }

    for (int k = 0; k < out->n; k++) {
        NnsInstr *instr = &out->items[k];
        int unconditional;
        int kind = nns_opcode_jump_kind(instr->opcode, &unconditional);
        if (kind == 0) {
            continue;
        }
        long end = op_units[k] + 1 + cache_units(instr->opcode);
        long target = kind == 1 ? end + instr->oparg
                      : kind == 2 ? end - instr->oparg : instr->oparg;
        if (target < 0 || target >= n_units || unit_instr[target] < 0) {
            bytecode_code_error(code, PyExc_ValueError,
                                "jump at offset %d lands at offset %ld, which does not "
                                "start an instruction", 2 * op_units[k], 2 * target);
            goto done;
        }
        instr->target = unit_instr[target];
    }

    if (decode_locations(code, out, op_units) < 0
        || decode_exception_table(code, out, op_units, unit_instr, n_units) < 0) {
        goto done;
    }
    ret = 0;

done:
    Py_XDECREF(co_code);
    PyMem_Free(unit_instr);
    PyMem_Free(op_units);
    if (ret < 0) {
        bytecode_list_clear(out);
    }
    return ret;
}

/* ---------------------------------------------------------------- writing tables */

typedef struct {
    unsigned char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} ByteBuffer;

static int
buffer_put(ByteBuffer *buf, unsigned int byte)
{
    if (buf->len == buf->cap) {
        Py_ssize_t cap = buf->cap ? buf->cap * 2 : 256;
        unsigned char *data = PyMem_Realloc(buf->data, (size_t)cap);
        if (data == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        buf->data = data;
        buf->cap = cap;
    }
    buf->data[buf->len++] = (unsigned char)byte;
    return 0;
}

static int
put_varint_lsb_first(ByteBuffer *buf, unsigned int value)
{
    while (value >= 64) {
        if (buffer_put(buf, 64 | (value & 63)) < 0) {
            return -1;
        }
        value >>= 6;
    }
    return buffer_put(buf, value);
}

static int
put_signed_varint(ByteBuffer *buf, int value)
{
    unsigned int folded = value < 0 ? ((0u - (unsigned int)value) << 1) | 1
                                    : (unsigned int)value << 1;
    return put_varint_lsb_first(buf, folded);
}

static int
put_varint_msb_first(ByteBuffer *buf, unsigned int value, unsigned int first_flag)
{
    int shift = 0;
    while (shift + 6 < 32 && (value >> (shift + 6)) != 0) {
        shift += 6;
    }
    for (; shift >= 0; shift -= 6) {
        unsigned int byte = (value >> shift) & 63;
        if (shift > 0) {
            byte |= 64;
        }
        if (buffer_put(buf, byte | first_flag) < 0) {
            return -1;
        }
        first_flag = 0;
    }
    return 0;
}

/* One location-table entry covering `units` (1-8) code units. */
static int
put_location_entry(ByteBuffer *buf, const NnsLocation *loc, int units, int *prev_line)
{
    unsigned int head = 0x80 | (unsigned int)(units - 1);
    if (!loc->has_line) {
        return buffer_put(buf, head | 15 << 3);
    }
    int delta = loc->line - *prev_line;
    *prev_line = loc->line;
    int one_line = loc->end_line == loc->line;
    if (loc->col < 0 && loc->end_col < 0 && one_line) {
        if (buffer_put(buf, head | 13 << 3) < 0) {
            return -1;
        }
        return put_signed_varint(buf, delta);
    }
    if (loc->col >= 0 && loc->end_col >= 0 && one_line) {
        int width = loc->end_col - loc->col;
        if (delta == 0 && loc->col < 80 && width >= 0 && width < 16) {
            if (buffer_put(buf, head | (unsigned int)(loc->col >> 3) << 3) < 0) {
                return -1;
            }
            return buffer_put(buf, (unsigned int)((loc->col & 7) << 4 | width));
        }
        if (delta >= 0 && delta <= 2 && loc->col < 128 && loc->end_col < 128) {
            if (buffer_put(buf, head | (unsigned int)(10 + delta) << 3) < 0
                || buffer_put(buf, (unsigned int)loc->col) < 0) {
                return -1;
            }
            return buffer_put(buf, (unsigned int)loc->end_col);
        }
    }
    if (buffer_put(buf, head | 14 << 3) < 0 || put_signed_varint(buf, delta) < 0
        || put_varint_lsb_first(buf, (unsigned int)(loc->end_line - loc->line)) < 0
        || put_varint_lsb_first(buf, (unsigned int)(loc->col + 1)) < 0) {
        return -1;
    }
    return put_varint_lsb_first(buf, (unsigned int)(loc->end_col + 1));
}

static int
put_location_run(ByteBuffer *buf, const NnsLocation *loc, int units, int *prev_line)
{
    while (units > 0) {
        int chunk = units > 8 ? 8 : units;
        if (put_location_entry(buf, loc, chunk, prev_line) < 0) {
            return -1;
        }
        units -= chunk;
    }
    return 0;
}

static int
extended_args_for(unsigned int oparg)
{
    return oparg > 0xFFFFFF ? 3 : oparg > 0xFFFF ? 2 : oparg > 0xFF ? 1 : 0;
}

/* ---------------------------------------------------------------- stack depth */

typedef struct {
    int *depth;     /* per instruction: depth on entry, -1 = not reached yet */
    char *queued;
    int *work;
    int n_work;
    int max_depth;
} DepthWalk;

static int
depth_reach(PyCodeObject *code, DepthWalk *walk, int index, int depth)
{
    if (depth < 0 || depth > MAX_STACK_DEPTH) {
        return bytecode_code_error(code, PyExc_ValueError,
                                   "stack depth %d at instruction %d is impossible",
                                   depth, index);
    }
    if (depth > walk->max_depth) {
        walk->max_depth = depth;
    }
    /* Compiled code reaches each instruction at one depth; keeping the largest is
     * the safe answer should that ever not hold. */
    if (walk->depth[index] >= depth) {
        return 0;
    }
    walk->depth[index] = depth;
    if (!walk->queued[index]) {
        walk->queued[index] = 1;
        walk->work[walk->n_work++] = index;
    }
    return 0;
}

static int
stack_effect_of(PyCodeObject *code, const NnsInstr *instr, int jump, int *effect)
{
    *effect = nns_opcode_stack_effect(instr->opcode, instr->oparg, jump);
    if (*effect == PY_INVALID_STACK_EFFECT) {
        return bytecode_code_error(code, PyExc_ValueError,
                                   "no stack effect known for opcode %d", instr->opcode);
    }
    return 0;
}

static int
compute_stack_size(PyCodeObject *code, const NnsInstrList *list, int *stack_size)
{
    int ret = -1;
    DepthWalk walk = {NULL, NULL, NULL, 0, 0};
    int n = list->n;

    walk.depth = PyMem_Malloc(((size_t)n + 1) * sizeof(int));
    walk.queued = PyMem_Calloc((size_t)n + 1, 1);
    walk.work = PyMem_Malloc(((size_t)n + 1) * sizeof(int));
    if (walk.depth == NULL || walk.queued == NULL || walk.work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int k = 0; k < n; k++) {
        walk.depth[k] = -1;
    }
    if (n > 0 && depth_reach(code, &walk, 0, nns_code_entry_stack_depth(code)) < 0) {
        goto done;
    }
    while (walk.n_work > 0) {
        int k = walk.work[--walk.n_work];
        walk.queued[k] = 0;
        const NnsInstr *instr = &list->items[k];
        int depth = walk.depth[k];
        int effect, unconditional;

        if (instr->handler.target >= 0
            && depth_reach(code, &walk, instr->handler.target,
                           instr->handler.depth + instr->handler.lasti + 1) < 0) {
            goto done;
        }
        if (nns_opcode_jump_kind(instr->opcode, &unconditional) != 0) {
            if (stack_effect_of(code, instr, 1, &effect) < 0
                || depth_reach(code, &walk, instr->target, depth + effect) < 0) {
                goto done;
            }
        }
        if (stack_effect_of(code, instr, 0, &effect) < 0) {
            goto done;
        }
        if (depth + effect > walk.max_depth) {
            walk.max_depth = depth + effect;
        }
        if (unconditional || nns_opcode_is_terminator(instr->opcode)) {
            continue;
        }
        if (k + 1 >= n) {
            bytecode_code_error(code, PyExc_ValueError, "execution falls off the end");
            goto done;
        }
        if (depth_reach(code, &walk, k + 1, depth + effect) < 0) {
            goto done;
        }
    }
    *stack_size = walk.max_depth;
    ret = 0;

done:
    PyMem_Free(walk.depth);
    PyMem_Free(walk.queued);
    PyMem_Free(walk.work);
    return ret;
}

/* ---------------------------------------------------------------- assembly */

/* Give every instruction its number of EXTENDED_ARG prefixes and its offset (in code
 * units; offsets[n] is the total), and every jump its oparg. */
static int
layout_offsets(PyCodeObject *code, const NnsInstrList *list, int *n_prefixes, int *offsets,
               int *opargs)
{
    int n = list->n;
    for (int k = 0; k < n; k++) {
        opargs[k] = list->items[k].oparg;
        n_prefixes[k] = extended_args_for((unsigned int)opargs[k]);
    }
    for (;;) {
        int changed = 0;
        long offset = 0;
        for (int k = 0; k < n; k++) {
            offsets[k] = (int)offset;
            offset += n_prefixes[k] + 1 + cache_units(list->items[k].opcode);
            if (offset > INT_MAX / 4) {
                return bytecode_code_error(code, PyExc_ValueError, "bytecode too long");
            }
        }
        offsets[n] = (int)offset;
        for (int k = 0; k < n; k++) {
            const NnsInstr *instr = &list->items[k];
            int unconditional;
            int kind = nns_opcode_jump_kind(instr->opcode, &unconditional);
            if (kind == 0) {
                continue;
            }
            if (instr->target < 0 || instr->target >= n) {
                return bytecode_code_error(code, PyExc_SystemError,
                                           "jump %d has no target", k);
            }
            int end = offsets[k] + n_prefixes[k] + 1 + cache_units(instr->opcode);
            int target = offsets[instr->target];
            int oparg = kind == 1 ? target - end : kind == 2 ? end - target : target;
            if (oparg < 0) {
                return bytecode_code_error(code, PyExc_SystemError,
                                           "jump %d points the wrong way for its opcode", k);
            }
            opargs[k] = oparg;
            int needed = extended_args_for((unsigned int)oparg);
            if (needed > n_prefixes[k]) {
                n_prefixes[k] = needed;
                changed = 1;
            }
        }
        if (!changed) {
            return 0;
        }
    }
}

static PyObject *
emit_code(const NnsInstrList *list, const int *n_prefixes, const int *offsets,
          const int *opargs)
{
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)offsets[list->n] * 2);
    if (bytes == NULL) {
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(bytes);
    for (int k = 0; k < list->n; k++) {
        unsigned int oparg = (unsigned int)opargs[k];
        int opcode = list->items[k].opcode;
        for (int shift = 8 * n_prefixes[k]; shift > 0; shift -= 8) {
            *out++ = (unsigned char)nns_opcodes.op_extended_arg;
            *out++ = (unsigned char)((oparg >> shift) & 0xFF);
        }
        *out++ = (unsigned char)opcode;
        *out++ = (unsigned char)(oparg & 0xFF);
        for (int c = cache_units(opcode); c > 0; c--) {
            *out++ = (unsigned char)nns_opcodes.op_cache;
            *out++ = 0;
        }
    }
    return bytes;
}

static PyObject *
emit_location_table(PyCodeObject *code, const NnsInstrList *list, const int *offsets)
{
    PyObject *result = NULL;
    ByteBuffer buf = {NULL, 0, 0};
    int prev_line = code->co_firstlineno;

    /* As the compiler writes them: 3.11 gives each instruction its own entry (or
     * more, 8 units each); 3.12+ give one run to consecutive instructions with the
     * same location (Python/assemble.c, assemble_location_info).  co_lines() reports
     * entry boundaries, so the choice shows. */
    for (int k = 0; k < list->n;) {
        const NnsLocation *loc = &list->items[k].loc;
        int end = k + 1;
        while (nns_opcodes.linetable_merges_runs && end < list->n
               && bytecode_same_location(loc, &list->items[end].loc)) {
            end++;
        }
        if (put_location_run(&buf, loc, offsets[end] - offsets[k], &prev_line) < 0) {
            goto done;
        }
        k = end;
    }
    result = PyBytes_FromStringAndSize((const char *)buf.data, buf.len);

done:
    PyMem_Free(buf.data);
    return result;
}

static PyObject *
emit_exception_table(const NnsInstrList *list, const int *offsets)
{
    PyObject *result = NULL;
    ByteBuffer buf = {NULL, 0, 0};

    for (int k = 0; k < list->n;) {
        const NnsHandler *handler = &list->items[k].handler;
        int end = k + 1;
        while (end < list->n && bytecode_same_handler(&list->items[end].handler, handler)) {
            end++;
        }
        if (handler->target >= 0) {
            if (put_varint_msb_first(&buf, (unsigned int)offsets[k], 0x80) < 0
                || put_varint_msb_first(&buf, (unsigned int)(offsets[end] - offsets[k]), 0) < 0
                || put_varint_msb_first(&buf, (unsigned int)offsets[handler->target], 0) < 0
                || put_varint_msb_first(
                       &buf, (unsigned int)(handler->depth << 1 | handler->lasti), 0) < 0) {
                goto done;
            }
        }
        k = end;
    }
    result = PyBytes_FromStringAndSize((const char *)buf.data, buf.len);

done:
    PyMem_Free(buf.data);
    return result;
}

PyObject *
bytecode_assemble(PyCodeObject *code, const NnsInstrList *list, PyObject *consts)
{
    return bytecode_assemble_with(code, list, consts, NULL);
}

PyObject *
bytecode_assemble_with(PyCodeObject *code, const NnsInstrList *list, PyObject *consts,
                       PyObject *extra)
{
    PyObject *result = NULL;
    /* owned */
    int *n_prefixes = NULL, *offsets = NULL, *opargs = NULL;
    PyObject *co_code = NULL, *linetable = NULL, *exceptiontable = NULL;
    PyObject *replace = NULL, *no_args = NULL, *kwargs = NULL;
    int stack_size = 0;

    n_prefixes = PyMem_Malloc(((size_t)list->n + 1) * sizeof(int));
    offsets = PyMem_Malloc(((size_t)list->n + 1) * sizeof(int));
    opargs = PyMem_Malloc(((size_t)list->n + 1) * sizeof(int));
    if (n_prefixes == NULL || offsets == NULL || opargs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int k = 0; k < list->n; k++) {
        const NnsHandler *handler = &list->items[k].handler;
        if (handler->target >= list->n || handler->depth < 0) {
            bytecode_code_error(code, PyExc_SystemError,
                                "instruction %d has a handler outside the code", k);
            goto done;
        }
    }
    if (layout_offsets(code, list, n_prefixes, offsets, opargs) < 0
        || compute_stack_size(code, list, &stack_size) < 0) {
        goto done;
    }
    co_code = emit_code(list, n_prefixes, offsets, opargs);
    if (co_code == NULL) {
        goto done;
    }
    linetable = emit_location_table(code, list, offsets);
    if (linetable == NULL) {
        goto done;
    }
    exceptiontable = emit_exception_table(list, offsets);
    if (exceptiontable == NULL) {
        goto done;
    }
    kwargs = Py_BuildValue("{s:O,s:O,s:O,s:i}", "co_code", co_code, "co_linetable", linetable,
                           "co_exceptiontable", exceptiontable, "co_stacksize", stack_size);
    if (kwargs == NULL) {
        goto done;
    }
    if (consts != NULL && PyDict_SetItemString(kwargs, "co_consts", consts) < 0) {
        goto done;
    }
    if (extra != NULL && PyDict_Update(kwargs, extra) < 0) {
        goto done;
    }
    replace = PyObject_GetAttrString((PyObject *)code, "replace");
    if (replace == NULL) {
        goto done;
    }
    no_args = PyTuple_New(0);
    if (no_args == NULL) {
        goto done;
    }
    result = PyObject_Call(replace, no_args, kwargs);
    if (result == NULL) {
        raise_from_current(code, "code.replace() refused the assembled bytecode");
    }

done:
    PyMem_Free(n_prefixes);
    PyMem_Free(offsets);
    PyMem_Free(opargs);
    Py_XDECREF(co_code);
    Py_XDECREF(linetable);
    Py_XDECREF(exceptiontable);
    Py_XDECREF(replace);
    Py_XDECREF(no_args);
    Py_XDECREF(kwargs);
    return result;
}

/* ---------------------------------------------------------------- to and from Python */

static PyObject *
location_to_python(const NnsLocation *loc)
{
    if (!loc->has_line) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(iiii)", loc->line, loc->end_line, loc->col, loc->end_col);
}

static PyObject *
handler_to_python(const NnsHandler *handler)
{
    if (handler->target < 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(iii)", handler->target, handler->depth, handler->lasti);
}

PyObject *
bytecode_list_to_python(const NnsInstrList *list)
{
    PyObject *result = PyList_New(list->n);
    if (result == NULL) {
        return NULL;
    }
    for (int k = 0; k < list->n; k++) {
        const NnsInstr *instr = &list->items[k];
        PyObject *item = Py_BuildValue("(iiiiNN)", instr->opcode, instr->oparg, instr->target,
                                       instr->flags, location_to_python(&instr->loc),
                                       handler_to_python(&instr->handler));
        if (item == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyList_SET_ITEM(result, k, item);
    }
    return result;
}

int
bytecode_list_from_python(PyCodeObject *code, PyObject *seq, NnsInstrList *out)
{
    /* A tuple of its own: converting an item can run Python (an oparg's __index__),
     * which may change or free what a list it was handed holds. */
    if (!PySequence_Check(seq)) {
        PyErr_SetString(PyExc_TypeError, "instructions must be a sequence");
        return -1;
    }
    PyObject *items = PySequence_Tuple(seq);
    if (items == NULL) {
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    if (n > INT_MAX / 4) {
        Py_DECREF(items);
        return bytecode_code_error(code, PyExc_ValueError, "too many instructions");
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = PyTuple_GET_ITEM(items, k);
        PyObject *loc = NULL, *handler = NULL;
        NnsInstr instr = {.loc = {0, 0, 0, -1, -1}, .handler = {-1, 0, 0}};
        if (!PyTuple_Check(item)
            || !PyArg_ParseTuple(item, "iiiiOO", &instr.opcode, &instr.oparg, &instr.target,
                                 &instr.flags, &loc, &handler)) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_TypeError, "an instruction must be a tuple");
            }
            goto error;
        }
        if (instr.opcode < 0 || instr.opcode > 255 || instr.oparg < 0
            || instr.target < -1 || instr.target >= n) {
            bytecode_code_error(code, PyExc_ValueError, "instruction %zd is out of range", k);
            goto error;
        }
        int unconditional;
        if ((nns_opcode_jump_kind(instr.opcode, &unconditional) != 0) != (instr.target >= 0)) {
            bytecode_code_error(code, PyExc_ValueError,
                                "instruction %zd: a jump needs a target, nothing else has one",
                                k);
            goto error;
        }
        if (loc != Py_None) {
            instr.loc.has_line = 1;
            if (!PyArg_ParseTuple(loc, "iiii", &instr.loc.line, &instr.loc.end_line,
                                  &instr.loc.col, &instr.loc.end_col)) {
                goto error;
            }
        }
        if (handler != Py_None) {
            if (!PyArg_ParseTuple(handler, "iii", &instr.handler.target, &instr.handler.depth,
                                  &instr.handler.lasti)) {
                goto error;
            }
            if (instr.handler.target < 0 || instr.handler.target >= n
                || instr.handler.depth < 0 || (instr.handler.lasti & ~1) != 0) {
                bytecode_code_error(code, PyExc_ValueError,
                                    "instruction %zd has a handler outside the code", k);
                goto error;
            }
        }
        if (bytecode_list_append(out, &instr) < 0) {
            goto error;
        }
    }
    Py_DECREF(items);
    return 0;

error:
    Py_DECREF(items);
    bytecode_list_clear(out);
    return -1;
}

PyObject *
bytecode_roundtrip(PyCodeObject *code)
{
    PyObject *result = NULL;
    NnsInstrList list = {NULL, 0, 0};

    if (bytecode_decode(code, &list) == 0) {
        result = bytecode_assemble(code, &list, NULL);
    }
    bytecode_list_clear(&list);
    return result;
}
