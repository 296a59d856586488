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
 * Later versions (opcode names from compat.h): 3.12 drops the FORWARD from the jump
 * names and JUMP_IF_*_OR_POP altogether (`or` is COPY; POP_JUMP_IF_TRUE; POP_TOP);
 * 3.13 puts TO_BOOL before the conditional jump and may fuse `LOAD_FAST x; LOAD_FAST
 * self` into LOAD_FAST_LOAD_FAST (split back before matching); 3.14 loads with
 * LOAD_FAST_BORROW and adds NOT_TAKEN after the jump (dropped with it).  From 3.12 on
 * the compiler also copies a small exit block (`return <value>`) into the first
 * branch instead of jumping to it: find_copied_exit() recognises that copy.  With
 * that copy an `if self.training:` statement whose bodies end in the same `return`
 * (or an `assert` of a constant-true test in a `finally:`) compiles to exactly the
 * instructions of a conditional expression, so the source positions decide: the
 * first branch of `a if self.training else b` lies left of the condition, a
 * statement's bodies lie after it (branch_precedes()).
 *
 * The rewritten site, in the original's textual order:
 *
 *     PUSH_NULL; LOAD_CONST ifexpr; LOAD self; LOAD_ATTR training; <a>; <b>;
 *     [SWAP 2 when negated]; PRECALL 3; CALL 3
 *
 * (3.12: no PRECALL; 3.13+: LOAD_CONST ifexpr before PUSH_NULL, no PRECALL.)
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
    int cond;           /* LOAD self; LOAD_ATTR training at cond + 1 */
    int test;           /* the conditional jump (3.13+: after a TO_BOOL) */
    int join;           /* where both branches' values meet */
    int negated;        /* the condition jumps when self.training is true */
    int first;          /* [first, first_end): the branch the condition falls into
                         * (3.14: after the jump's NOT_TAKEN, which is dropped) */
    int first_end;      /* [first_end, second): the unconditional jump closing it,
                         * or a copy of the exit block at `join` (3.12+); dropped */
    int second;         /* [second, second_end): the branch the condition jumps to */
    int second_end;
} Site;

static int
is_self_load(PyCodeObject *code, const NnsInstr *instr)
{
    int op = instr->opcode;
    if (op < 0 || (op != nns_opcodes.op_load_fast && op != nns_opcodes.op_load_deref
                   && op != nns_opcodes.op_load_classderef
                   && op != nns_opcodes.op_load_fast_check
                   && op != nns_opcodes.op_load_fast_borrow)) {
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

/* The longest exit block (with line numbers) the compiler copies into a branch:
 * MAX_COPY_SIZE in CPython's Python/flowgraph.c.  No longer: a longer common tail
 * of two branches is the code after an `if` statement, e.g. the shared
 * `.method(arg); return arg` of `if self.training: self.a.method(arg) else:
 * self.b.method(arg)`, which must stay a statement. */
#define MAX_COPIED_EXIT 4

/* Does every located instruction of [start, end) lie before `at` in the source?
 * `a if self.training else b` puts <a> left of its condition; an `if self.training:`
 * statement puts both bodies after it.  The two can compile to the same instructions
 * once the compiler copies a `return` block into each body (3.12+), or once jump
 * threading gives a statement's branches a common join, so the text decides. */
static int
branch_precedes(const NnsInstrList *list, int start, int end, const NnsLocation *at)
{
    for (int k = start; k < end; k++) {
        const NnsLocation *loc = &list->items[k].loc;
        if (!loc->has_line || (list->items[k].flags & NNS_INSTR_INSERTED)) {
            continue;
        }
        if (loc->end_line > at->line
            || (loc->end_line == at->line && loc->end_col >= 0 && at->col >= 0
                && loc->end_col > at->col)) {
            return 0;
        }
    }
    return 1;
}

/* 3.12+ copy a small block that ends the function (`STORE_FAST y; LOAD_FAST y;
 * RETURN_VALUE`, or a bare RETURN_VALUE) into the branch that would have jumped to
 * it, so the first branch ends with a copy of the join rather than a jump:
 *
 *     first: <a>; <exit copy>; second: <b>; join: <exit>
 *
 * Finds that shape: [*first_end, second) is a copy (same opcodes, opargs, source
 * locations and handlers, no jumps, ending the function) of the `join` block right
 * after the second branch, and both branches are value branches ending there.  The
 * locations tell a copy from the two `return` statements of an `if self.training:`
 * statement, whose tails may have the same instructions but not the same lines.  The copy is
 * dropped by the rewrite.  An exit copy starting with POP_TOP is not taken: the
 * value is then discarded, and the bytecode is that of an `if self.training:`
 * statement (left alone, as on 3.11).  The first branch must lie left of the
 * condition in the source (branch_precedes()), or it is a statement's body running
 * on into the copy of the statement after it. */
static int
find_copied_exit(const NnsInstrList *list, int first, int second, const NnsHandler *handler,
                 const NnsLocation *condition, int *depth, int *first_end, int *join)
{
    const NnsInstr *items = list->items;
    if (!nns_opcodes.exit_blocks_copied) {
        return 0;
    }
    for (int len = 1; len <= MAX_COPIED_EXIT; len++) {
        int copy = second - len;
        int unconditional;
        if (copy <= first) {
            return 0;
        }
        if (nns_opcode_jump_kind(items[copy].opcode, &unconditional) != 0) {
            return 0;   /* a longer block would hold this jump too */
        }
        if (!nns_opcode_is_terminator(items[second - 1].opcode)
            || items[copy].opcode == nns_opcodes.op_pop_top
            || !branch_precedes(list, first, copy, condition)
            || !is_value_branch(list, first, copy, copy, handler, depth)) {
            continue;
        }
        for (int end = second + 1; end + len <= list->n; end++) {
            int same = 1;
            for (int i = 0; i < len && same; i++) {
                same = items[end + i].opcode == items[copy + i].opcode
                       && items[end + i].oparg == items[copy + i].oparg
                       && bytecode_same_location(&items[end + i].loc, &items[copy + i].loc)
                       && bytecode_same_handler(&items[end + i].handler,
                                                &items[copy + i].handler);
            }
            if (same && is_value_branch(list, second, end, end, handler, depth)) {
                *first_end = copy;
                *join = end;
                return 1;
            }
        }
    }
    return 0;
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
    int test_at = cond + 2;
    if (items[test_at].opcode == nns_opcodes.op_to_bool) {
        test_at++;
    }
    int first = test_at + 1;
    if (first + 2 >= list->n) {
        return 0;
    }
    if (items[first].opcode == nns_opcodes.op_not_taken) {
        first++;
    }
    const NnsInstr *test = &items[test_at];
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
    int second = test->target;
    int first_end = second - 1;
    for (int k = cond + 1; k < first; k++) {
        /* 3.14 leaves NOT_TAKEN (which cannot raise) out of the exception table */
        if (items[k].opcode != nns_opcodes.op_not_taken
            && !bytecode_same_handler(&items[k].handler, handler)) {
            return 0;
        }
    }
    int join, second_end;
    if (first_end > first && bytecode_same_handler(&items[first_end].handler, handler)
        && nns_opcode_jump_kind(items[first_end].opcode, &unconditional) == 1
        && unconditional) {
        join = bytecode_resolve_jumps(list, first_end);
        if (join <= second
            || !is_value_branch(list, first, first_end, join, handler, depth)) {
            return 0;
        }
        second_end = second + 1;
        for (; second_end <= join; second_end++) {
            if (bytecode_resolve_jumps(list, second_end) == join
                && is_value_branch(list, second, second_end, join, handler, depth)) {
                break;
            }
        }
        if (second_end > join) {
            return 0;
        }
    }
    else if (!find_copied_exit(list, first, second, handler, &items[cond + 1].loc, depth,
                               &first_end, &join)) {
        return 0;
    }
    else {
        second_end = join;
    }
    if (!branch_precedes(list, first, first_end, &items[cond + 1].loc)) {
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
    *site = (Site){cond, test_at, join, negated, first, first_end, second, second_end};
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
    map[s->cond] = pos;              /* a jump to the condition enters at the call's start */
    map[s->cond + 1] = pos + 3;
    for (int k = s->cond + 2; k < s->first; k++) {
        map[k] = -1;                 /* [TO_BOOL,] the jump[, NOT_TAKEN] */
    }
    pos += 4;
    for (int k = s->first; k < s->first_end; k++) {
        map[k] = pos++;
    }
    for (int k = s->first_end; k < s->second; k++) {
        map[k] = -1;                 /* the closing jump, or a copied exit block */
    }
    int second_at = pos;
    for (int k = s->second; k < s->second_end; k++) {
        map[k] = pos++;
    }
    int after_second = pos;
    pos += (s->negated ? 1 : 0) + (nns_opcodes.op_precall >= 0 ? 1 : 0) + 1;
    for (int k = s->second_end; k < n; k++) {
        map[k] = pos++;
    }

    const NnsInstr *load_self = &items[s->cond];
    const NnsInstr *test = &items[s->test];
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
    /* The call's shape: NULL below the callable (3.11, 3.12) or above it (3.13+). */
    const NnsInstr *below = nns_opcodes.call_null_below_callable ? &push_null : &load_ifexpr;
    const NnsInstr *above = nns_opcodes.call_null_below_callable ? &load_ifexpr : &push_null;
    if (bytecode_list_append(out, below) < 0 || bytecode_list_append(out, above) < 0
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
        || (nns_opcodes.op_precall >= 0 && bytecode_list_append(out, &precall) < 0)
        || bytecode_list_append(out, &call) < 0) {
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

/* The single load a two-local superinstruction splits into, or -1 if `op` is none. */
static int
split_load_opcode(int op)
{
    if (op < 0) {
        return -1;
    }
    if (op == nns_opcodes.op_load_fast_load_fast) {
        return nns_opcodes.op_load_fast;
    }
    if (op == nns_opcodes.op_load_fast_borrow_load_fast_borrow) {
        return nns_opcodes.op_load_fast_borrow;
    }
    return -1;
}

/* 3.13+ fuse `LOAD_FAST x; LOAD_FAST self` into one LOAD_FAST_LOAD_FAST: split every
 * such pair whose second load is `self` followed by LOAD_ATTR training back into two
 * loads, so that a site starts at an instruction of its own.  Writes the new list
 * into `out` (empty) and returns 1, or returns 0 when there is nothing to split;
 * -1 with an exception set on failure. */
static int
split_self_loads(PyCodeObject *code, const NnsInstrList *list, NnsInstrList *out)
{
    int ret = -1;
    int *map = NULL;    /* old index -> new index */
    int splits = 0;

    for (int k = 0; k + 1 < list->n; k++) {
        const NnsInstr *instr = &list->items[k];
        int single = split_load_opcode(instr->opcode);
        if (single >= 0) {
            NnsInstr second = *instr;
            second.opcode = single;
            second.oparg = instr->oparg & 15;
            if (is_self_load(code, &second) && is_training_load(code, &list->items[k + 1])) {
                splits++;
            }
        }
    }
    if (splits == 0) {
        return 0;
    }
    map = PyMem_Malloc(((size_t)list->n + 1) * sizeof(int));
    if (map == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int k = 0, pos = 0; k < list->n; k++) {
        map[k] = pos++;
        const NnsInstr *instr = &list->items[k];
        int single = split_load_opcode(instr->opcode);
        if (single >= 0 && k + 1 < list->n) {
            NnsInstr second = *instr;
            second.opcode = single;
            second.oparg = instr->oparg & 15;
            if (is_self_load(code, &second) && is_training_load(code, &list->items[k + 1])) {
                pos++;
            }
        }
    }
    for (int k = 0; k < list->n; k++) {
        NnsInstr instr = list->items[k];
        if (instr.target >= 0) {
            instr.target = map[instr.target];
        }
        if (instr.handler.target >= 0) {
            instr.handler.target = map[instr.handler.target];
        }
        int expanded = map[k] + 1 < (k + 1 < list->n ? map[k + 1] : map[k] + 1);
        if (expanded) {
            NnsInstr first = instr;
            first.opcode = split_load_opcode(instr.opcode);
            first.oparg = instr.oparg >> 4;
            instr.opcode = first.opcode;
            instr.oparg &= 15;
            if (bytecode_list_append(out, &first) < 0) {
                goto done;
            }
        }
        if (bytecode_list_append(out, &instr) < 0) {
            goto done;
        }
    }
    ret = 1;

done:
    PyMem_Free(map);
    return ret;
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
    int split = split_self_loads(code, &list, &next);
    if (split < 0) {
        goto done;
    }
    if (split > 0) {
        NnsInstrList old = list;
        list = next;
        next = old;
        bytecode_list_clear(&next);
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
