/* rewrite.c - `a if self.training else b` -> `ifexpr(self.training, a, b)`, on bytecode.
 *
 * Design note: what a site looks like and how it is found.
 *
 * CPython 3.11 compiles a conditional expression used as a value to
 *
 *     cond:  LOAD_FAST self                  (or LOAD_DEREF / LOAD_CLASSDEREF)
 *            LOAD_ATTR training
 *            POP_JUMP_FORWARD_IF_FALSE second  (IF_TRUE for `not self.training`)
 *     first: <a>                             (runs when the jump is not taken)
 *            JUMP_FORWARD join               (first_end)
 *     second:<b>
 *     join:  <whatever consumes the value>
 *
 * with two twists.  Jump threading sends any jump that lands on an unconditional jump
 * straight to that jump's target, so the first branch's JUMP_FORWARD, and jumps inside
 * either branch, may skip past `join` to an outer join; and the second branch has no
 * closing jump of its own when it falls through into `join`.  So the join is where the
 * first branch's closing jump leads once unconditional jumps are followed, and the
 * second branch ends at the first instruction E after it from which unconditional
 * jumps lead to the join, provided [second, E) is closed: every jump in it lands
 * inside it or (through unconditional jumps) on the join, never elsewhere.
 *
 * When the join is itself a JUMP_IF_TRUE_OR_POP (the expression is an operand of
 * `or`; JUMP_IF_FALSE_OR_POP and `and` likewise), the optimizer also threads the
 * branches' own `or` jumps through it: a JUMP_IF_TRUE_OR_POP that would have reached
 * the join goes straight to where the join sends a true value, and a
 * JUMP_IF_FALSE_OR_POP becomes a POP_JUMP_IF_FALSE to the instruction after the join
 * (where the join sends a false value, popped).  Both are exits of the branch too:
 * a value that reaches them is a value that reaches the join.
 *
 * Both branches are then checked by simulating the stack: each must start from the
 * depth it was entered at, never go below it, and leave exactly one more value at
 * every exit.  This is what tells a conditional expression used as a value from one
 * used as the test of an `if` (no join: its branches jump to the statement's two
 * targets and leave nothing), and from an `if self.training:` statement.  A branch
 * may not call (the seeds' rule), store, delete, import, yield or await, since after
 * the rewrite it always runs; calls this pass inserted for an inner site are allowed.
 * Nothing outside the site may jump into it, and the whole site must sit under one
 * exception handler.
 *
 * The rewritten site, in the original's textual order:
 *
 *     PUSH_NULL; LOAD_CONST ifexpr; LOAD self; LOAD_ATTR training; <a>; <b>;
 *     [SWAP 2 when negated]; PRECALL 3; CALL 3
 *
 * Jumps that left the first branch now go to the start of <b>; jumps that left the
 * second go to the instruction after <b>; a threaded POP_JUMP_IF_FALSE exit turns
 * back into the JUMP_IF_FALSE_OR_POP it was (it must keep the value now).  Sites are
 * rewritten innermost first (condition positions from last to first), so an outer
 * site sees its inner ones already turned into straight-line calls.
 */
#include "rewrite.h"

#include <limits.h>

#include "bytecode.h"

#define UNREACHED INT_MIN

int
rewrite_may_apply(PyCodeObject *code)
{
    PyObject *names = code->co_names;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "training") == 0) {
            return 1;
        }
    }
    return 0;
}

typedef struct {
    int cond;           /* LOAD self */
    int join;           /* where both branches' values meet */
    int negated;        /* the condition jumps when self.training is true */
    int first;          /* [first, first_end): the branch the condition falls into */
    int first_end;      /* the unconditional jump closing it; dropped */
    int second;         /* [second, second_end): the branch the condition jumps to */
    int second_end;
} Site;

static int
is_self_load(PyCodeObject *code, const NnsInstr *instr)
{
    int op = instr->opcode;
    if (op != nns_opcodes.op_load_fast && op != nns_opcodes.op_load_deref
        && op != nns_opcodes.op_load_classderef) {
        return 0;
    }
    PyObject *name = nns_code_localsplus_name(code, instr->oparg);
    return name != NULL && PyUnicode_Check(name)
           && PyUnicode_CompareWithASCIIString(name, "self") == 0;
}

static int
is_training_load(PyCodeObject *code, const NnsInstr *instr)
{
    if (instr->opcode != nns_opcodes.op_load_attr) {
        return 0;
    }
    int index = nns_load_attr_name_index(instr->oparg);
    if (index < 0 || index >= PyTuple_GET_SIZE(code->co_names)) {
        return 0;
    }
    PyObject *name = PyTuple_GET_ITEM(code->co_names, index);
    return PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "training") == 0;
}

/* Record that instruction `k` is reached at `depth`: 0 when it was reached at another. */
static int
reach(int *depth, int k, int value)
{
    if (depth[k] == UNREACHED) {
        depth[k] = value;
        return 1;
    }
    return depth[k] == value;
}

/* How a jump out of a branch reaches the join (see the design note). */
typedef enum {
    EXIT_NONE,          /* it does not: not a branch of this join */
    EXIT_PLAIN,         /* lands on the join, through unconditional jumps */
    EXIT_KEEP,          /* a JUMP_IF_*_OR_POP threaded through a join of its kind */
    EXIT_POPPED,        /* a POP_JUMP_IF_* threaded past a JUMP_IF_*_OR_POP join */
} ExitKind;

/* Where a value entering `index` ends up: follows unconditional jumps and jumps of
 * opcode `op`.  -1 when they loop. */
static int
follow_jumps_of(const NnsInstrList *list, int index, int op)
{
    for (int steps = 0; steps <= list->n; steps++) {
        const NnsInstr *instr = &list->items[index];
        int unconditional;
        if (nns_opcode_jump_kind(instr->opcode, &unconditional) == 0
            || !(unconditional || instr->opcode == op)) {
            return index;
        }
        index = instr->target;
    }
    return -1;
}

static ExitKind
classify_exit(const NnsInstrList *list, const NnsInstr *instr, int join)
{
    int target = instr->target;
    if (bytecode_resolve_jumps(list, target) == join) {
        return EXIT_PLAIN;
    }
    int join_op = list->items[join].opcode;
    int popping;
    if (join_op == nns_opcodes.op_jump_if_true_or_pop) {
        popping = nns_opcodes.op_pop_jump_forward_if_false;
    }
    else if (join_op == nns_opcodes.op_jump_if_false_or_pop) {
        popping = nns_opcodes.op_pop_jump_forward_if_true;
    }
    else {
        return EXIT_NONE;
    }
    if (instr->opcode == join_op) {
        int dest = follow_jumps_of(list, target, join_op);
        return dest >= 0 && dest == follow_jumps_of(list, join, join_op) ? EXIT_KEEP
                                                                         : EXIT_NONE;
    }
    if (instr->opcode == popping && join + 1 < list->n) {
        int dest = bytecode_resolve_jumps(list, target);
        return dest >= 0 && dest == bytecode_resolve_jumps(list, join + 1) ? EXIT_POPPED
                                                                           : EXIT_NONE;
    }
    return EXIT_NONE;
}

/* The opcode that keeps the value where `popping` (an EXIT_POPPED jump) dropped it. */
static int
keeping_opcode(int popping)
{
    return popping == nns_opcodes.op_pop_jump_forward_if_false
               ? nns_opcodes.op_jump_if_false_or_pop
               : nns_opcodes.op_jump_if_true_or_pop;
}

/* Is [start, end) a branch of a conditional expression joining at `join`?  See the
 * design note.  `depth` is scratch space of at least end - start ints. */
static int
is_value_branch(const NnsInstrList *list, int start, int end, int join,
                const NnsHandler *handler, int *depth)
{
    int exits = 0;

    if (start >= end) {
        return 0;
    }
    for (int k = start; k < end; k++) {
        depth[k - start] = UNREACHED;
    }
    depth[0] = 0;
    for (int k = start; k < end; k++) {
        const NnsInstr *instr = &list->items[k];
        int op = instr->opcode;
        int unconditional;
        int kind = nns_opcode_jump_kind(op, &unconditional);
        int jumps_always = kind != 0 && unconditional;

        if (!bytecode_same_handler(&instr->handler, handler) || nns_opcode_is_store(op)
            || (nns_opcode_is_call(op) && !(instr->flags & NNS_INSTR_INSERTED))
            || (nns_opcode_is_terminator(op) && !jumps_always)) {
            return 0;
        }
        /* Forward jumps only: an expression has no loops of its own. */
        if (kind != 0 && instr->target <= k) {
            return 0;
        }
        int d = depth[k - start];
        if (d == UNREACHED) {
            continue;   /* dead code: checked above, contributes no flow */
        }
        if ((op == nns_opcodes.op_swap || op == nns_opcodes.op_copy) && instr->oparg > d) {
            return 0;   /* would reach below the branch's own values */
        }
        if (kind != 0) {
            int effect = nns_opcode_stack_effect(op, instr->oparg, 1);
            if (effect == PY_INVALID_STACK_EFFECT || d + effect < 0) {
                return 0;
            }
            if (instr->target < end) {
                if (!reach(depth, instr->target - start, d + effect)) {
                    return 0;
                }
            }
            else {
                /* An exit carries the branch's value: one more than on entry, or, for
                 * a popped exit, that value is what the jump tested and dropped. */
                ExitKind exit = classify_exit(list, instr, join);
                int carried = exit == EXIT_POPPED ? d : d + effect;
                if (exit == EXIT_NONE || carried != 1) {
                    return 0;
                }
                exits++;
            }
        }
        if (!jumps_always) {
            int effect = nns_opcode_stack_effect(op, instr->oparg, 0);
            if (effect == PY_INVALID_STACK_EFFECT || d + effect < 0) {
                return 0;
            }
            if (k + 1 < end) {
                if (!reach(depth, k + 1 - start, d + effect)) {
                    return 0;
                }
            }
            else if (d + effect == 1) {
                exits++;
            }
            else {
                return 0;
            }
        }
    }
    return exits > 0;
}

/* Does a qualifying site start at `cond`?  1 and *site filled, or 0. */
static int
find_site(PyCodeObject *code, const NnsInstrList *list, int cond, int *depth, Site *site)
{
    const NnsInstr *items = list->items;
    int unconditional;

    if (cond + 4 >= list->n || !is_self_load(code, &items[cond])
        || !is_training_load(code, &items[cond + 1])) {
        return 0;
    }
    const NnsInstr *test = &items[cond + 2];
    int negated;
    if (test->opcode == nns_opcodes.op_pop_jump_forward_if_false) {
        negated = 0;
    }
    else if (test->opcode == nns_opcodes.op_pop_jump_forward_if_true) {
        negated = 1;
    }
    else {
        return 0;
    }
    const NnsHandler *handler = &items[cond].handler;
    int first = cond + 3;
    int second = test->target;
    int first_end = second - 1;
    if (first_end <= first || !bytecode_same_handler(&items[cond + 1].handler, handler)
        || !bytecode_same_handler(&test->handler, handler)
        || !bytecode_same_handler(&items[first_end].handler, handler)
        || nns_opcode_jump_kind(items[first_end].opcode, &unconditional) != 1
        || !unconditional) {
        return 0;
    }
    int join = bytecode_resolve_jumps(list, first_end);
    if (join <= second
        || !is_value_branch(list, first, first_end, join, handler, depth)) {
        return 0;
    }
    int second_end = second + 1;
    for (; second_end <= join; second_end++) {
        if (bytecode_resolve_jumps(list, second_end) == join
            && is_value_branch(list, second, second_end, join, handler, depth)) {
            break;
        }
    }
    if (second_end > join) {
        return 0;
    }
    /* Nothing else may enter the site past its first instruction: the dropped jumps
     * and the branches' insides have no place in the new layout to be entered at. */
    for (int k = 0; k < list->n; k++) {
        int target = items[k].handler.target;
        if (target >= cond && target < second_end) {
            return 0;
        }
        target = items[k].target;
        if ((k < cond || k >= second_end) && target > cond && target < second_end) {
            return 0;
        }
    }
    *site = (Site){cond, join, negated, first, first_end, second, second_end};
    return 1;
}

static NnsInstr
inserted(int opcode, int oparg, const NnsInstr *located_like, int handler_target)
{
    NnsInstr instr = {.opcode = opcode, .oparg = oparg, .target = -1,
                      .flags = NNS_INSTR_INSERTED, .loc = located_like->loc,
                      .handler = located_like->handler};
    instr.handler.target = handler_target;
    return instr;
}

/* Copy instruction `k` into `out` with its jump and handler targets moved to the new
 * layout.  A jump of a branch ending at `region_end` that leaves it is an exit and
 * goes to `exit_to`; region_end == -1 means the instruction is outside the site and
 * every target is simply mapped. */
static int
copy_moved(PyCodeObject *code, const NnsInstrList *list, const Site *site, int k,
           int region_end, int exit_to, const int *map, NnsInstrList *out)
{
    NnsInstr instr = list->items[k];
    if (instr.target >= 0) {
        if (region_end < 0 || instr.target < region_end) {
            instr.target = map[instr.target];
        }
        else {
            if (classify_exit(list, &instr, site->join) == EXIT_POPPED) {
                instr.opcode = keeping_opcode(instr.opcode);
            }
            instr.target = exit_to;
        }
    }
    if (instr.handler.target >= 0) {
        instr.handler.target = map[instr.handler.target];
    }
    if ((list->items[k].target >= 0 && instr.target < 0)
        || (list->items[k].handler.target >= 0 && instr.handler.target < 0)) {
        return bytecode_code_error(code, PyExc_SystemError,
                                   "rewrite lost the target of instruction %d", k);
    }
    return bytecode_list_append(out, &instr);
}

/* Write the rewritten instruction list of `site` into `out` (empty).  `map` is
 * scratch space of list->n ints: old index -> new index, -1 for dropped ones. */
static int
apply_site(PyCodeObject *code, const NnsInstrList *list, const Site *s, int const_index,
           int *map, NnsInstrList *out)
{
    const NnsInstr *items = list->items;
    int n = list->n;
    int pos = s->cond;

    for (int k = 0; k < s->cond; k++) {
        map[k] = k;
    }
    map[s->cond] = pos;              /* a jump to the condition enters at PUSH_NULL */
    map[s->cond + 1] = pos + 3;
    map[s->cond + 2] = -1;
    pos += 4;
    for (int k = s->first; k < s->first_end; k++) {
        map[k] = pos++;
    }
    map[s->first_end] = -1;
    int second_at = pos;
    for (int k = s->second; k < s->second_end; k++) {
        map[k] = pos++;
    }
    int after_second = pos;
    pos += s->negated ? 3 : 2;
    for (int k = s->second_end; k < n; k++) {
        map[k] = pos++;
    }

    const NnsInstr *load_self = &items[s->cond];
    const NnsInstr *test = &items[s->cond + 2];
    int handler = load_self->handler.target >= 0 ? map[load_self->handler.target] : -1;
    NnsInstr push_null = inserted(nns_opcodes.op_push_null, 0, load_self, handler);
    NnsInstr load_ifexpr = inserted(nns_opcodes.op_load_const, const_index, load_self, handler);
    NnsInstr swap = inserted(nns_opcodes.op_swap, 2, test, handler);
    NnsInstr precall = inserted(nns_opcodes.op_precall, 3, test, handler);
    NnsInstr call = inserted(nns_opcodes.op_call, 3, test, handler);

    for (int k = 0; k < s->cond; k++) {
        if (copy_moved(code, list, s, k, -1, 0, map, out) < 0) {
            return -1;
        }
    }
    if (bytecode_list_append(out, &push_null) < 0
        || bytecode_list_append(out, &load_ifexpr) < 0
        || copy_moved(code, list, s, s->cond, -1, 0, map, out) < 0
        || copy_moved(code, list, s, s->cond + 1, -1, 0, map, out) < 0) {
        return -1;
    }
    for (int k = s->first; k < s->first_end; k++) {
        if (copy_moved(code, list, s, k, s->first_end, second_at, map, out) < 0) {
            return -1;
        }
    }
    for (int k = s->second; k < s->second_end; k++) {
        if (copy_moved(code, list, s, k, s->second_end, after_second, map, out) < 0) {
            return -1;
        }
    }
    /* ifexpr(cond, true_value, false_value): when negated, <a> (run when the flag is
     * false) was pushed first and is the false value. */
    if ((s->negated && bytecode_list_append(out, &swap) < 0)
        || bytecode_list_append(out, &precall) < 0 || bytecode_list_append(out, &call) < 0) {
        return -1;
    }
    for (int k = s->second_end; k < n; k++) {
        if (copy_moved(code, list, s, k, -1, 0, map, out) < 0) {
            return -1;
        }
    }
    if (out->n != pos) {
        return bytecode_code_error(code, PyExc_SystemError,
                                   "rewrite laid out %d instructions, wrote %d", pos, out->n);
    }
    return 0;
}

static PyObject *
consts_with(PyObject *consts, PyObject *extra)
{
    Py_ssize_t n = PyTuple_GET_SIZE(consts);
    PyObject *result = PyTuple_New(n + 1);
    if (result == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTuple_SET_ITEM(result, i, Py_NewRef(PyTuple_GET_ITEM(consts, i)));
    }
    PyTuple_SET_ITEM(result, n, Py_NewRef(extra));
    return result;
}

PyObject *
rewrite_training_ifexpr(PyCodeObject *code, PyObject *ifexpr, int *n_sites)
{
    PyObject *result = NULL;
    /* owned */
    PyObject *consts = NULL;
    NnsInstrList list = {NULL, 0, 0};
    NnsInstrList next = {NULL, 0, 0};
    int *scratch = NULL;
    int scratch_size = 0;
    int sites = 0;

    *n_sites = 0;
    if (!PyCallable_Check(ifexpr)) {
        PyErr_Format(PyExc_TypeError, "rewrite: ifexpr must be callable, not %.100s",
                     Py_TYPE(ifexpr)->tp_name);
        goto done;
    }
    if (!rewrite_may_apply(code)) {
        result = Py_NewRef((PyObject *)code);
        goto done;
    }
    if (bytecode_decode(code, &list) < 0) {
        goto done;
    }
    Py_ssize_t const_index = PyTuple_GET_SIZE(code->co_consts);
    if (const_index >= INT_MAX) {
        bytecode_code_error(code, PyExc_ValueError, "too many constants");
        goto done;
    }
    for (int cond = list.n - 1; cond >= 0; cond--) {
        Site site;
        if (scratch_size < list.n + 1) {
            PyMem_Free(scratch);
            scratch_size = 2 * list.n + 1;
            scratch = PyMem_Malloc((size_t)scratch_size * sizeof(int));
            if (scratch == NULL) {
                PyErr_NoMemory();
                goto done;
            }
        }
        if (!find_site(code, &list, cond, scratch, &site)) {
            continue;
        }
        if (apply_site(code, &list, &site, (int)const_index, scratch, &next) < 0) {
            goto done;
        }
        /* The rewritten list replaces the current one; instructions before `cond`
         * kept their indices, so the scan goes on where it was. */
        NnsInstrList old = list;
        list = next;
        next = old;
        bytecode_list_clear(&next);
        sites++;
    }
    if (sites == 0) {
        result = Py_NewRef((PyObject *)code);
        goto done;
    }
    consts = consts_with(code->co_consts, ifexpr);
    if (consts == NULL) {
        goto done;
    }
    result = bytecode_assemble(code, &list, consts);
    if (result != NULL) {
        *n_sites = sites;
    }

done:
    Py_XDECREF(consts);
    bytecode_list_clear(&list);
    bytecode_list_clear(&next);
    PyMem_Free(scratch);
    return result;
}
