"""A code object's instructions as a flow graph, and the `if` statements found in it.

`decode(code)` gives the instructions as the C layer sees them (csrc/bytecode.h:
EXTENDED_ARG folded, caches dropped, jump targets and handlers as instructions), with
two-local superinstructions split in two so that each instruction touches at most one
local.  `Analysis(code)` then computes, once per code object:

- successors (normal flow; exception edges kept apart), the stack depth at each
  instruction, and post-dominators on the normal flow graph (the exit a virtual node);
- liveness of locals (backward; a read is a use, a store a kill) and definite
  assignment (forward, over every path; a comprehension's restore of the variable it
  saved, 3.12+, counts as "maybe unbound");
- the `if` sites: every conditional jump that takes `bool()` of its operand, with the
  instruction where `bool()` is taken, its two sides, where they meet again (the
  immediate post-dominator: an instruction, or the exit when a side returns), the
  region of each side, the locals live into the sides and out of the merge, and
  either nothing or the reason it cannot become a `torch.cond`.

Everything version-specific is asked of `versions`.
"""

from __future__ import annotations

import dis
import types
from dataclasses import dataclass, field
from typing import Any, Optional

from nnscaler_eval import _C
from nnscaler_eval.bytecode.versions import OPS, bool_is_taken_before_jump, stack_effect

EXIT = -1   # the virtual exit node of the flow graph


@dataclass(eq=False)
class Instr:
    """One instruction; `target` and `handler[0]` are Instr objects while a pass edits."""

    opcode: int
    arg: int = 0
    target: Optional["Instr"] = None
    loc: Optional[tuple[int, int, int, int]] = None
    # (handler instruction, stack depth to unwind to, push lasti)
    handler: Optional[tuple["Instr", int, int]] = None
    flags: int = 0

    def like(self, opcode: int, arg: int = 0, target: Optional["Instr"] = None) -> "Instr":
        """A new instruction at this one's location, under its handler."""
        return Instr(opcode, arg, target, self.loc, self.handler)

    def __repr__(self) -> str:
        name = dis.opname[self.opcode]
        return f"<{name} {self.arg}{' -> ' + dis.opname[self.target.opcode] if self.target else ''}>"


def decode(code: types.CodeType) -> list[Instr]:
    """`code`'s instructions, superinstructions on two locals split in two."""
    raw = _C.code_instructions(code)
    instrs = [Instr(op, arg, None, loc, None, flags) for op, arg, _, flags, loc, _ in raw]
    for item, (_, _, target, _, _, handler) in zip(instrs, raw):
        if target >= 0:
            item.target = instrs[target]
        if handler is not None:
            item.handler = (instrs[handler[0]], handler[1], handler[2])
    pairs = {pair: (first, second) for pair, first, second in OPS.pairs}
    if not any(i.opcode in pairs for i in instrs):
        return instrs
    split: list[Instr] = []
    replaced: dict[int, Instr] = {}
    for item in instrs:
        if item.opcode in pairs:
            first, second = pairs[item.opcode]
            head = item.like(first, item.arg >> 4)
            replaced[id(item)] = head
            split += [head, item.like(second, item.arg & 15)]
        else:
            split.append(item)
    for item in split:
        if item.target is not None and id(item.target) in replaced:
            item.target = replaced[id(item.target)]
        if item.handler is not None and id(item.handler[0]) in replaced:
            item.handler = (replaced[id(item.handler[0])], *item.handler[1:])
    return split


def assemble(code: types.CodeType, instrs: list[Instr], **replace: Any) -> types.CodeType:
    """A new code object from `instrs` (C assembler: offsets, EXTENDED_ARG, caches,
    location and exception tables, stack size), with `replace` fields set too."""
    index = {id(item): k for k, item in enumerate(instrs)}
    raw = []
    for item in instrs:
        target = index[id(item.target)] if item.target is not None else -1
        handler = ((index[id(item.handler[0])], item.handler[1], item.handler[2])
                   if item.handler is not None else None)
        raw.append((item.opcode, item.arg, target, item.flags, item.loc, handler))
    return _C.assemble_code(code, raw, replace)


def local_name(code: types.CodeType, index: int) -> str:
    """Name of fast-locals slot `index` (locals, then cells, then free variables)."""
    return code._varname_from_oparg(index)  # type: ignore[attr-defined]


def cell_names(code: types.CodeType) -> frozenset[str]:
    return frozenset(code.co_cellvars) | frozenset(code.co_freevars)


@dataclass
class Site:
    """One conditional jump on `bool()` of a value, as a candidate `torch.cond`.

    Indices are into the analysed instruction list.  `sides[True]` starts where
    control goes when `bool()` answers True.  `merge` is the instruction where both
    sides meet, or EXIT when one of them leaves the function (then both sides run to a
    return: the `cond` produces the return value).  `refusal` is None for a site that
    can be converted; else why not (shown only if its operand turns out a tensor).
    """

    jump: int
    bool_at: int                        # the instruction that takes bool()
    line: int
    sides: dict[bool, int]
    merge: int
    regions: dict[bool, frozenset[int]] = field(default_factory=dict)
    live_in: tuple[str, ...] = ()       # read by either side before being written
    maybe_unbound_in: frozenset[str] = frozenset()
    live_out: tuple[str, ...] = ()      # written by a side and live where they meet
    calls: bool = False                 # a side holds a call (the ifexpr rule)
    refusal: Optional[str] = None
    loop: Optional["Loop"] = None       # the `while` loop whose test this is


@dataclass
class Loop:
    """A `while` loop on `bool()` of a value, as a candidate `while_loop`.

    CPython 3.11-3.13 compile `while test: body` rotated: the test once before the loop
    (the *entry* site) and once more after the body (the *back* site, whose jump goes
    back to the body); 3.14 compiles it once, the body jumping back to the test (the
    back site is then the entry too).  `body` is the body's first instruction and `exit` where control
    goes when the test fails (both past unconditional jumps); `region` runs from `body`
    to the back site's `bool()` (the body, then the test's second copy).  `carried` are
    the locals the region writes that are live into it or after the loop (the
    while_loop's carried values, in order); `inputs` the other locals it reads (extra
    parameters of the body function).  `exits` are the instructions where control lands
    when a test fails (the join hooks go there)."""

    back: int                           # bool_at of the back site
    enter: bool                         # the outcome of bool() that runs the body
    body: int
    exit: int
    line: int
    entries: tuple[int, ...] = ()       # bool_at of every site that tests it
    exits: tuple[int, ...] = ()
    region: frozenset[int] = frozenset()
    carried: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    refusal: Optional[str] = None


class Analysis:
    """Flow facts of one code object, and its `if` sites (see the module docstring)."""

    def __init__(self, code: types.CodeType, instrs: Optional[list[Instr]] = None) -> None:
        self.code = code
        self.instrs = instrs if instrs is not None else decode(code)
        self.index = {id(item): k for k, item in enumerate(self.instrs)}
        self.cells = cell_names(code)
        n = len(self.instrs)
        self.succ: list[list[int]] = [self._successors(k) for k in range(n)]
        self.exc_succ: list[Optional[int]] = [
            self.index[id(item.handler[0])] if item.handler is not None else None
            for item in self.instrs]
        self.pred: list[list[int]] = [[] for _ in range(n)]
        for k, succ in enumerate(self.succ):
            for s in succ:
                if s != EXIT:
                    self.pred[s].append(k)
        self.depth = self._depths()
        self.restores = self._comprehension_restores()
        self.live_before = self._liveness()
        self.assigned_before = self._definite_assignment()
        self.ipdom = self._post_dominators()
        self.sites = self._find_sites()
        self.loops = self._find_loops()

    # -- local variables touched by an instruction ---------------------------------

    def reads(self, k: int) -> Optional[str]:
        item = self.instrs[k]
        if item.opcode in OPS.local_loads or item.opcode == OPS.load_fast_and_clear:
            return local_name(self.code, item.arg)
        return None

    def writes(self, k: int) -> Optional[str]:
        item = self.instrs[k]
        if item.opcode in (OPS.store_fast, OPS.delete_fast):
            return local_name(self.code, item.arg)
        return None

    def touches_cell(self, k: int) -> bool:
        item = self.instrs[k]
        if item.opcode in OPS.cell_ops:
            return True
        name = self.reads(k) or self.writes(k)
        return name is not None and name in self.cells

    # -- graph -----------------------------------------------------------------------

    def _successors(self, k: int) -> list[int]:
        item = self.instrs[k]
        if item.opcode in OPS.exits:
            return [EXIT]
        follow = [k + 1] if k + 1 < len(self.instrs) else [EXIT]
        if item.target is None:
            return follow
        target = self.index[id(item.target)]
        if item.opcode in OPS.unconditional_jumps:
            return [target]
        return follow + [target]

    def _depths(self) -> list[Optional[int]]:
        """Stack depth before each instruction (None: unreachable)."""
        depth: list[Optional[int]] = [None] * len(self.instrs)
        work = [(0, 0)]
        while work:
            k, d = work.pop()
            if depth[k] is not None:
                continue
            depth[k] = d
            item = self.instrs[k]
            if item.handler is not None:
                h = self.index[id(item.handler[0])]
                if depth[h] is None:
                    work.append((h, item.handler[1] + item.handler[2] + 1))
            if item.target is not None:
                t = self.index[id(item.target)]
                if depth[t] is None:
                    work.append((t, d + stack_effect(item.opcode, item.arg, True)))
            if item.opcode in OPS.exits or item.opcode in OPS.unconditional_jumps:
                continue
            if k + 1 < len(self.instrs) and depth[k + 1] is None:
                work.append((k + 1, d + stack_effect(item.opcode, item.arg, False)))
        return depth

    def _comprehension_restores(self) -> frozenset[int]:
        """Stores that may put back an unbound value: 3.12+ inlines comprehensions
        (PEP 709), saving their variable with LOAD_FAST_AND_CLEAR (which reads an
        unbound local as NULL) and storing it back after.  Every store of such a name
        counts as "maybe unbound" for definite assignment: conservative, and it needs
        no tracking of the saved value through the stack."""
        if OPS.load_fast_and_clear < 0:
            return frozenset()
        saved = {local_name(self.code, item.arg) for item in self.instrs
                 if item.opcode == OPS.load_fast_and_clear}
        return frozenset(k for k in range(len(self.instrs)) if self.writes(k) in saved)

    def _liveness(self) -> list[frozenset[str]]:
        """Locals live before each instruction (normal and exception edges)."""
        n = len(self.instrs)
        live: list[frozenset[str]] = [frozenset()] * n
        changed = True
        while changed:
            changed = False
            for k in range(n - 1, -1, -1):
                out: set[str] = set()
                for s in self.succ[k]:
                    if s != EXIT:
                        out |= live[s]
                if self.exc_succ[k] is not None:
                    out |= live[self.exc_succ[k]]
                written = self.writes(k)
                if written is not None:
                    out.discard(written)
                read = self.reads(k)
                if read is not None:
                    out.add(read)
                new = frozenset(out)
                if new != live[k]:
                    live[k] = new
                    changed = True
        return live

    def _definite_assignment(self) -> list[Optional[frozenset[str]]]:
        """Locals bound on every path to each instruction (None: unreached)."""
        n = len(self.instrs)
        code = self.code
        params = code.co_argcount + code.co_kwonlyargcount + \
            bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
        entry = frozenset(code.co_varnames[:params])
        before: list[Optional[frozenset[str]]] = [None] * n
        before[0] = entry
        changed = True
        while changed:
            changed = False
            for k in range(n):
                state = before[k]
                if state is None:
                    continue
                after = set(state)
                name = self.writes(k)
                if name is not None:
                    if self.instrs[k].opcode == OPS.delete_fast or k in self.restores:
                        after.discard(name)
                    else:
                        after.add(name)
                out = frozenset(after)
                targets = [s for s in self.succ[k] if s != EXIT]
                if self.exc_succ[k] is not None:
                    targets.append(self.exc_succ[k])
                    exc_state = state   # an exception may come before the store
                else:
                    exc_state = None
                for s in targets:
                    flow = exc_state if (exc_state is not None and s == self.exc_succ[k]
                                         and s not in self.succ[k]) else out
                    old = before[s]
                    new = flow if old is None else (old & flow)
                    if new != old:
                        before[s] = new
                        changed = True
        return before

    def _post_dominators(self) -> list[int]:
        """Immediate post-dominator of each instruction on the normal flow graph (the
        exit: EXIT), by the iterative algorithm over reverse post-order."""
        n = len(self.instrs)
        # order nodes by post-order of the reversed graph from the exit
        order: list[int] = []
        seen = [False] * n
        exits = [k for k in range(n) if EXIT in self.succ[k]]
        stack: list[tuple[int, int]] = [(k, 0) for k in exits]
        for k in exits:
            seen[k] = True
        while stack:
            k, i = stack.pop()
            preds = self.pred[k]
            if i < len(preds):
                stack.append((k, i + 1))
                p = preds[i]
                if not seen[p]:
                    seen[p] = True
                    stack.append((p, 0))
            else:
                order.append(k)
        rank = {k: r for r, k in enumerate(order)}
        rank[EXIT] = len(order)
        ipdom: dict[int, int] = {EXIT: EXIT}

        def intersect(a: int, b: int) -> int:
            while a != b:
                while rank[a] < rank[b]:
                    a = ipdom[a]
                while rank[b] < rank[a]:
                    b = ipdom[b]
            return a

        changed = True
        while changed:
            changed = False
            for k in reversed(order):
                known = [s for s in self.succ[k] if s in ipdom]
                if not known:
                    continue
                new = known[0]
                for s in known[1:]:
                    new = intersect(s, new)
                if ipdom.get(k) != new:
                    ipdom[k] = new
                    changed = True
        return [ipdom.get(k, EXIT) for k in range(n)]

    # -- sites ---------------------------------------------------------------------------

    def _find_sites(self) -> dict[int, Site]:
        sites: dict[int, Site] = {}
        for k, item in enumerate(self.instrs):
            if item.opcode in OPS.bool_jumps_if_true:
                jumps_when = True
            elif item.opcode in OPS.bool_jumps_if_false:
                jumps_when = False
            else:
                continue
            if self.depth[k] is None:
                continue
            bool_at = k
            if bool_is_taken_before_jump():
                prev = self.instrs[k - 1] if k > 0 else None
                if prev is None or not (
                        prev.opcode == OPS.to_bool
                        or (prev.opcode == OPS.compare_op and prev.arg & OPS.compare_bool_flag)):
                    continue        # the operand is a bool already (IS_OP, CONTAINS_OP...)
                if self.pred[k] != [k - 1]:
                    continue        # something jumps between bool() and the jump
                bool_at = k - 1
            target = self.index[id(item.target)]   # type: ignore[arg-type]
            follow = k + 1
            site = Site(jump=k, bool_at=bool_at, line=(item.loc or (0,))[0],
                        sides={jumps_when: target, not jumps_when: follow},
                        merge=self.ipdom[k])
            site.refusal = self._examine(site)
            sites[bool_at] = site
        return sites

    def _region(self, start: int, merge: int) -> Optional[set[int]]:
        """Instructions reached from `start` before `merge`, exception edges included."""
        region: set[int] = set()
        work = [start]
        while work:
            k = work.pop()
            if k == merge or k == EXIT or k in region:
                continue
            region.add(k)
            work.extend(self.succ[k])
            if self.exc_succ[k] is not None:
                work.append(self.exc_succ[k])
        return region

    def _examine(self, site: Site) -> Optional[str]:
        code = self.code
        if code.co_flags & (0x20 | 0x80 | 0x100 | 0x200):
            return "it is in a generator or coroutine"
        jump = site.jump
        base = self.depth[jump]
        if base is None:
            return "it is unreachable"
        base += stack_effect(self.instrs[jump].opcode, self.instrs[jump].arg, False)
        enclosing = self.instrs[site.bool_at].handler
        if enclosing is not None:
            return "the `if` sits inside a try/with block"
        merge = site.merge
        regions = {}
        for side, start in site.sides.items():
            region = self._region(start, merge)
            assert region is not None
            for k in region:
                d = self.depth[k]
                item = self.instrs[k]
                if d is None:
                    continue
                if d < base or (item.handler is not None and item.handler[1] < base):
                    return ("a side leaves an enclosing loop or expression "
                            "(break, or return inside a for loop)")
                if self.touches_cell(k):
                    return "a side uses a variable shared with a nested function (a cell)"
                if item.opcode == OPS.delete_fast:
                    return f"a side deletes the local {local_name(code, item.arg)!r}"
                if item.opcode in OPS.yields:
                    return "a side yields"
            # returning with values of an enclosing loop on the stack pops below base
            for k in region:
                item = self.instrs[k]
                if item.opcode in OPS.returns and self.depth[k] is not None:
                    on_stack = self.depth[k] - (0 if item.opcode == OPS.return_const else 1)
                    if on_stack != base and base > 0:
                        return ("a side returns from inside an enclosing loop")
            if site.bool_at in region or jump in region:
                return ("it is the test of a `while` loop (the loop runs again through "
                        "it): loops on tensors are not converted")
            regions[side] = frozenset(region)
        if merge != EXIT and self.depth[merge] != base:
            return "its two sides meet with a value on the stack (a conditional expression)"
        site.regions = regions
        both = regions[True] | regions[False]
        site.calls = any(self.instrs[k].opcode in (OPS.call, OPS.call_kw, OPS.call_function_ex)
                         for k in both)
        # locals out: written by a side and live where they meet; in: read by a side
        # before it writes them, or out and not written on every path of a side
        live_out: list[str] = []
        if merge != EXIT:
            written = {self.writes(k) for k in both} - {None}
            live_out = sorted(n for n in written if n in self.live_before[merge])  # type: ignore[type-var]
        site.live_out = tuple(live_out)
        live_in: set[str] = set()
        for side, start in site.sides.items():
            live_in |= self._live_in_side(start, regions[side], merge, frozenset(live_out))
        assigned_at_fork = self.assigned_before[site.bool_at] or frozenset()
        site.live_in = tuple(sorted(live_in))
        site.maybe_unbound_in = frozenset(n for n in live_in if n not in assigned_at_fork)
        if merge != EXIT:
            at_merge = self.assigned_before[merge] or frozenset()
            for name in live_out:
                if name not in at_merge:
                    return (f"{name!r} is assigned on one side only and may be unbound "
                            "where the sides meet")
        return None

    def _live_in_side(self, start: int, region: frozenset[int], merge: int,
                      at_merge: frozenset[str]) -> set[str]:
        """Locals read in `region` before any write on some path from `start`, plus
        those of `at_merge` (the side function returns them) not written on every path
        to the merge."""
        # backward fixpoint restricted to the region
        live: dict[int, frozenset[str]] = {k: frozenset() for k in region}
        changed = True
        order = sorted(region, reverse=True)
        while changed:
            changed = False
            for k in order:
                out: set[str] = set()
                for s in self.succ[k]:
                    if s == merge:
                        out |= at_merge
                    elif s in live:
                        out |= live[s]
                h = self.exc_succ[k]
                if h is not None and h in live:
                    out |= live[h]
                w = self.writes(k)
                if w is not None:
                    out.discard(w)
                r = self.reads(k)
                if r is not None:
                    out.add(r)
                new = frozenset(out)
                if new != live[k]:
                    live[k] = new
                    changed = True
        if start == merge:
            return set(at_merge)
        return set(live[start])

    # -- `while` loops ---------------------------------------------------------------

    def _resolve(self, k: int) -> int:
        """Where control really goes from `k`: past unconditional jumps and no-ops."""
        seen = set()
        while k != EXIT and k not in seen:
            seen.add(k)
            item = self.instrs[k]
            if item.opcode in OPS.unconditional_jumps or item.opcode in (OPS.nop, OPS.not_taken):
                k = self.succ[k][0]
            else:
                break
        return k

    def _find_loops(self) -> list[Loop]:
        """Sites that close a `while` loop (see Loop), and the sites that open it."""
        loops: list[Loop] = []
        for back in self.sites.values():
            for enter in (True, False):
                body = self._resolve(back.sides[enter])
                exit_ = self._resolve(back.sides[not enter])
                if body == EXIT or body == exit_:
                    continue
                region, leaves, closes = self._loop_region(body, back.bool_at, exit_)
                if not closes:
                    continue
                entries = [s for s in self.sites.values() if s is not back
                           and s.bool_at not in region
                           and self._resolve(s.sides[enter]) == body
                           and self._resolve(s.sides[not enter]) == exit_]
                if not entries:
                    # Not rotated (3.14): the loop jumps back to the test itself, so the
                    # back site is the entry too: the test's code, in the region, is
                    # entered from outside it.
                    # A loop that can end otherwise is not taken for one here: an `if`
                    # inside an outer loop looks the same from its sides.
                    if leaves or not self._tests_again(region, back.bool_at):
                        continue
                loop = Loop(back=back.bool_at, enter=enter, body=body, exit=exit_,
                            line=(entries[0] if entries else back).line,
                            entries=tuple(s.bool_at for s in entries) + (back.bool_at,),
                            exits=tuple(sorted({s.sides[not enter] for s in entries}
                                               | {back.sides[not enter]})),
                            region=frozenset(region))
                loop.refusal = self._examine_loop(loop, back, leaves)
                for site in (*entries, back):
                    site.loop = loop
                    site.refusal = loop.refusal
                loops.append(loop)
                break
        return loops

    def _tests_again(self, region: set[int], stop: int) -> bool:
        """Does the region end with a jump back to the start of the test's code (a loop
        compiled unrotated): an unconditional jump in it whose target, entered from
        outside the region too, runs straight (one successor each) to `stop`?"""
        for j in region:
            if self.instrs[j].opcode not in OPS.unconditional_jumps:
                continue
            start = self.succ[j][0]
            if start == EXIT or not any(p not in region for p in self.pred[start]):
                continue
            k, steps = start, 0
            while k != stop and k in region and len(self.succ[k]) == 1 and steps < 10_000:
                k, steps = self.succ[k][0], steps + 1
            if k == stop:
                return True
        return False

    def _loop_region(self, body: int, stop: int, exit_: int) -> tuple[set[int], bool, bool]:
        """Instructions run from `body` up to `stop` (exception edges included);
        whether control can leave the loop on the way (reach `exit_` or the exit), and
        whether it reaches `stop`."""
        region: set[int] = set()
        closes = leaves = False
        work = [body]
        while work:
            k = work.pop()
            if k == stop:
                closes = True
                continue
            if k == EXIT or self._resolve(k) == exit_:
                leaves = True
                continue
            if k in region:
                continue
            region.add(k)
            work.extend(self.succ[k])
            if self.exc_succ[k] is not None:
                work.append(self.exc_succ[k])
        return region, leaves, closes

    def _examine_loop(self, loop: Loop, back: Site, leaves: bool) -> Optional[str]:
        code = self.code
        if code.co_flags & (0x20 | 0x80 | 0x100 | 0x200):
            return "it is in a generator or coroutine"
        if leaves:
            return ("the loop can end other than by its test (break, return or raise in "
                    "the body, or a test joined with and/or)")
        for k in loop.entries:
            if self.instrs[k].handler is not None:
                return "the loop sits inside a try/with block"
        base = self.depth[back.jump]
        if base is None:
            return "it is unreachable"
        base += stack_effect(self.instrs[back.jump].opcode, self.instrs[back.jump].arg, False)
        for k in loop.region:
            d = self.depth[k]
            item = self.instrs[k]
            if d is None:
                continue
            if d < base or (item.handler is not None and item.handler[1] < base):
                return "the body leaves an enclosing loop or expression"
            if self.touches_cell(k):
                return "the body uses a variable shared with a nested function (a cell)"
            if item.opcode == OPS.delete_fast:
                return f"the body deletes the local {local_name(code, item.arg)!r}"
            if item.opcode in OPS.yields:
                return "the body yields"
        written = {self.writes(k) for k in loop.region} - {None}
        live = self.live_before[loop.body] | self.live_before[loop.exit] \
            if loop.exit != EXIT else self.live_before[loop.body]
        carried = sorted(n for n in written if n in live)  # type: ignore[type-var]
        loop.carried = tuple(carried)
        live_in = self._live_in_side(loop.body, loop.region, loop.back, frozenset(carried))
        loop.inputs = tuple(sorted(live_in - set(carried)))
        for k in loop.entries:
            assigned = self.assigned_before[k] or frozenset()
            for name in carried:
                if name not in assigned:
                    return (f"{name!r} is assigned in the loop and used after it or in the "
                            "next iteration, but may be unbound before it")
        for k in loop.exits:
            assigned = self.assigned_before[k] or frozenset()
            for name in carried:
                if name not in assigned:
                    return f"{name!r} may be unbound where the loop ends"
        return None
