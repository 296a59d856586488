"""Code written for a capture: the user's code with hooks at its `if` statements, the
same with every side effect checked, and one function per side of an `if`.

Three products, each a new code object made from the analysed instructions of a base
code object (code_graph.Analysis; the base is the code a frame runs, after the
`self.training` rewrite when there is one):

- the *capture* flavour, run for real while a capture records: the same
  instructions, plus
    fork:  before `bool()` of an `if`'s test, `test = site.fork(test)`;
    join:  where the sides of convertible `if`s meet, `a, b = merge.join(a, b)` for
           the locals they may change;
    ret:   before a return inside a side that returns, `value = ret(value)`.
  The hooks return their arguments unchanged unless the capture converted that `if`
  (capture/branches.py): then `fork` answers the outcome as a plain bool, the frame
  runs the side taken as eagerly as before, and `join` / `ret` hand back the values
  the graph now stands for.
- the *checked* flavour, run on fake tensors while one side of a converted `if` is
  traced: the capture flavour plus a check before everything that could change state
  outside the side: calls go through a trampoline that screens the callable,
  attribute and item stores, in-place operators, iteration of iterators, `with`, and
  stores of globals, free variables or imports are refused where reached.  The checks
  are the `Hooks` given; they raise to refuse.
- a *side function*: the checked flavour entered at one side of an `if`, its
  parameters the locals live into the side (those possibly unbound come as
  `UNBOUND` and are deleted first), ending where the sides meet with
  `return locals()` (or at the side's own returns when it leaves the function).

The emitted instruction shapes come from `versions`; assembly (offsets, caches,
tables, stack size) is the C layer's (csrc/bytecode.c).
"""

from __future__ import annotations

import builtins
import dis
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from nnscaler_eval.bytecode import versions
from nnscaler_eval.bytecode.code_graph import (EXIT, Analysis, Instr, Loop, Site, assemble,
                                                local_name)
from nnscaler_eval.bytecode.versions import INTRINSICS_REFUSED, OPS

CO_OPTIMIZED, CO_NEWLOCALS = 0x1, 0x2


class _Unbound:
    """The value handed to a side function for a local that is unbound at the fork."""

    _instance: Optional["_Unbound"] = None

    def __new__(cls) -> "_Unbound":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<unbound>"


UNBOUND = _Unbound()


@dataclass
class Hooks:
    """The callables the written code calls (capture/branches.py provides them).

    `fork(site)` / `join(merge_names)` return the bound hook for one site / merge
    point; `ret` closes an open `if` that returns.  The checked flavour's screens
    take the value they look at and return it (or raise to refuse): `call` is the
    trampoline `call(callable, args, names)`, `call_ex(callable, args, kwargs)`;
    `attr_store`, `item_store`, `inplace`, `iterate`, `enter` screen an attribute
    store's owner, an item store's container, an in-place operator's left operand,
    what is iterated, a context manager; `fresh` marks a container built here;
    `refuse(reason)` always raises.
    """

    fork: Callable[[Any], Callable[[Any], Any]]
    join: Callable[[tuple[str, ...]], Callable[..., Any]]
    ret: Callable[[Any], Any]
    call: Callable[..., Any]
    call_kw: Callable[..., Any]
    call_ex: Callable[..., Any]
    attr_store: Callable[[Any], Any]
    item_store: Callable[[Any], Any]
    inplace: Callable[[Any], Any]
    iterate: Callable[[Any], Any]
    enter: Callable[[Any], Any]
    fresh: Callable[[Any], Any]
    refuse: Callable[[str], Any]


class _Consts:
    """co_consts being extended: objects added once, found by identity."""

    def __init__(self, consts: tuple[Any, ...]) -> None:
        self.items = list(consts)
        self._added: dict[int, int] = {}

    def index(self, value: Any) -> int:
        found = self._added.get(id(value))
        if found is None:
            found = self._added[id(value)] = len(self.items)
            self.items.append(value)
        return found


@dataclass
class Written:
    """One flavour's instruction list, and where each base instruction went."""

    instrs: list[Instr]
    entry: list[Instr]        # base index -> first instruction written for it
    core: list[Optional[Instr]]   # base index -> the instruction itself (None: dropped)
    consts: _Consts
    analysis: Analysis
    joins: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # base index of a site's bool() -> the first instruction of its fork call (the test
    # on top of the stack): where a loop's body function stops
    forks: dict[int, Instr] = field(default_factory=dict)


def _emit(where: Instr, pairs: list[tuple[int, int]]) -> list[Instr]:
    return [where.like(op, arg) for op, arg in pairs]


def write(analysis: Analysis, hooks: Hooks, checked: bool,
          site_ref: Callable[[Site], Any], merge_ref: Callable[[int, tuple[str, ...]], Any]
          ) -> Written:
    """The capture flavour (checked=False) or the checked flavour of `analysis.code`.

    `site_ref(site)` / `merge_ref(merge, names)` make the objects whose hooks the code
    calls (they end up in co_consts)."""
    code = analysis.code
    base = analysis.instrs
    consts = _Consts(code.co_consts)
    out: list[Instr] = []
    entry: list[Optional[Instr]] = [None] * len(base)
    core: list[Optional[Instr]] = [None] * len(base)
    forks: dict[int, Instr] = {}

    # Where the sides of convertible `if`s meet, and the locals each join hands over.
    joins: dict[int, list[str]] = {}
    exit_regions: set[int] = set()
    for site in analysis.sites.values():
        if site.refusal is not None:
            continue
        if site.loop is not None:
            # where the loop ends: its carried locals become the while_loop's results
            for k in site.loop.exits:
                names = joins.setdefault(k, [])
                names += [n for n in site.loop.carried if n not in names]
            continue
        if site.merge == EXIT:
            exit_regions |= site.regions[True] | site.regions[False]
        else:
            names = joins.setdefault(site.merge, [])
            names += [n for n in site.live_out if n not in names]
    join_names = {k: tuple(v) for k, v in joins.items()}

    def const(value: Any) -> int:
        return consts.index(value)

    def local_index(name: str) -> int:
        return code.co_varnames.index(name)

    kw_names = -1            # 3.11/3.12: the KW_NAMES index for the next call
    pending: list[int] = []  # base instructions that wrote nothing yet: their entry is
                             # the next instruction written
    ex_null: set[int] = set()   # 3.14: PUSH_NULLs that fill CALL_FUNCTION_EX's kwargs slot
    if checked and OPS.ex_kwargs_always:
        for k, item in enumerate(base):
            if item.opcode == OPS.call_function_ex and k > 0 and \
                    base[k - 1].opcode == OPS.push_null:
                ex_null.add(k - 1)

    def put(k: int, items: list[Instr], itself: Optional[Instr]) -> None:
        nonlocal pending
        if items:
            for p in pending:
                entry[p] = items[0]
            pending = []
            entry[k] = items[0]
            out.extend(items)
        else:
            pending.append(k)
        core[k] = itself

    for k, item in enumerate(base):
        op, arg = item.opcode, item.arg
        prefix: list[Instr] = []
        # -- hooks of the `if` sites --------------------------------------------------
        if k in join_names:
            names = join_names[k]
            hook = const(merge_ref(k, names).join)
            prefix += _emit(item, versions.push_callable(hook))
            prefix += [item.like(OPS.load_fast, local_index(n)) for n in names]
            prefix += _emit(item, versions.call(len(names)))
            if names:
                prefix.append(item.like(OPS.unpack_sequence, len(names)))
                prefix += [item.like(OPS.store_fast, local_index(n)) for n in names]
            else:
                prefix.append(item.like(OPS.pop_top))
        site = analysis.sites.get(k)
        itself: list[Instr]
        if site is not None:
            fork = const(site_ref(site).fork)
            if op == OPS.compare_op and arg & OPS.compare_bool_flag:
                # 3.13+: the compare takes bool() itself; make it give the value, hook
                # it, then take bool() as TO_BOOL does
                itself = [item.like(op, arg & ~OPS.compare_bool_flag)]
                hook_call = _emit(item, versions.call_on_top(fork))
                forks[k] = hook_call[0]
                itself += hook_call
                itself.append(item.like(OPS.to_bool))
                put(k, prefix + itself, itself[0])
                continue
            hook_call = _emit(item, versions.call_on_top(fork))
            forks[k] = hook_call[0]
            prefix += hook_call
        if k in exit_regions and op in OPS.returns:
            if op == OPS.return_const:
                prefix.append(item.like(OPS.load_const, arg))
            prefix += _emit(item, versions.call_on_top(const(hooks.ret)))
            if op == OPS.return_const:
                itself = [item.like(OPS.return_value)]
                put(k, prefix + itself, itself[0])
                continue
        if not checked:
            copy = item.like(_plain_load(op), arg, item.target)
            copy.flags = item.flags
            put(k, prefix + [copy], copy)
            continue
        # -- the checked flavour ------------------------------------------------------
        itself = []
        suffix: list[Instr] = []
        if op == OPS.load_method:                       # 3.11: a plain attribute load
            prefix += [item.like(OPS.push_null), item.like(OPS.swap, 2)]
            itself = [item.like(OPS.load_attr, arg)]
        elif op == OPS.load_attr and arg & OPS.load_attr_method_bit:
            plain = item.like(OPS.load_attr, arg & ~OPS.load_attr_method_bit)
            if OPS.null_below_callable:                 # 3.12
                prefix += [item.like(OPS.push_null), item.like(OPS.swap, 2)]
                itself = [plain]
            else:                                       # 3.13+
                itself = [plain]
                suffix = [item.like(OPS.push_null)]
        elif op == OPS.kw_names:
            kw_names = arg
            put(k, prefix, None)
            continue
        elif op == OPS.precall and not _calls_comprehension(base, k):
            put(k, prefix, None)
            continue
        elif op == OPS.call and _calls_comprehension(base, k):
            pass   # a comprehension or generator expression made here: its code is checked
        elif op == OPS.call:
            if kw_names >= 0:
                itself = _emit(item, versions.through_trampoline(
                    "call", arg, const(hooks.call), names_index=kw_names))
                kw_names = -1
            else:
                itself = _emit(item, versions.through_trampoline("call", arg, const(hooks.call)))
        elif op == OPS.call_kw:
            itself = _emit(item, versions.through_trampoline("call_kw", arg, const(hooks.call_kw)))
        elif op == OPS.call_function_ex:
            with_kwargs = 1 if OPS.ex_kwargs_always else (arg & 1)
            itself = _emit(item, versions.through_trampoline("ex", with_kwargs,
                                                             const(hooks.call_ex)))
        elif k in ex_null:
            itself = [item.like(OPS.load_const, const(None))]
        elif op in (OPS.store_attr, OPS.delete_attr):
            prefix += _emit(item, versions.call_on_top(const(hooks.attr_store)))
        elif op in (OPS.store_subscr, OPS.delete_subscr):
            prefix += _emit(item, versions.call_on_copy(const(hooks.item_store), 2))
        elif op == OPS.store_slice:
            prefix += _emit(item, versions.call_on_copy(const(hooks.item_store), 3))
        elif op == OPS.binary_op and arg in OPS.inplace_binary_ops:
            prefix += _emit(item, versions.call_on_copy(const(hooks.inplace), 2))
        elif op in OPS.iterating:
            prefix += _emit(item, versions.call_on_top(const(hooks.iterate)))
        elif op == OPS.before_with:
            prefix += _emit(item, versions.call_on_top(const(hooks.enter)))
        elif op in OPS.fresh_builders:
            suffix = _emit(item, versions.call_on_top(const(hooks.fresh)))
        elif op in (OPS.store_deref, OPS.delete_deref) and \
                local_name(code, arg) in code.co_freevars:
            prefix += _refusal(item, const, hooks, "stores a variable of an enclosing function "
                               f"({local_name(code, arg)!r})")
        elif op == OPS.load_super_attr:
            prefix += _refusal(item, const, hooks, "calls super()")
        elif op in OPS.refused_in_checked or (
                op == OPS.call_intrinsic_1 and arg in INTRINSICS_REFUSED):
            prefix += _refusal(item, const, hooks, f"runs {dis.opname[op]} "
                               "(global state, imports or printing)")
        if not itself:
            copy = item.like(_plain_load(op), arg, item.target)
            copy.flags = item.flags
            itself = [copy]
        put(k, prefix + itself + suffix, itself[0])

    if pending:
        raise ValueError(f"{code.co_qualname}: the code ends without an instruction")
    # Jumps and handlers go to what was written for their base instruction.
    where = {id(item): entry[k] for k, item in enumerate(base)}
    for item in out:
        if item.target is not None and id(item.target) in where:
            item.target = where[id(item.target)]
        if item.handler is not None and id(item.handler[0]) in where:
            item.handler = (where[id(item.handler[0])], item.handler[1], item.handler[2])
    return Written(out, entry, core, consts, analysis,   # type: ignore[arg-type]
                   join_names, forks)


def _calls_comprehension(base: list[Instr], k: int) -> bool:
    """`k` is the call of a comprehension's (3.11) or a generator expression's
    function: `MAKE_FUNCTION ...; <iterable>; GET_ITER; [PRECALL 0]; CALL 0`.  Its
    callable sits where a method would, the iterator where `self` would, so it is not
    a call the trampoline can take; the function was made from a code object of this
    code, whose frames the evaluator runs checked like any other."""
    j = k - 1
    if base[k].opcode == OPS.call and OPS.precall >= 0:
        if j < 0 or base[j].opcode != OPS.precall:
            return False
        j -= 1
    return base[k].arg == 0 and j >= 0 and base[j].opcode == dis.opmap["GET_ITER"]


def _plain_load(op: int) -> int:
    """3.14's borrowed load (LOAD_FAST_BORROW) is safe only where the compiler proved
    it; the hooks run Python between loads and uses and store into locals, so written
    code loads with a reference."""
    return OPS.load_fast if op == OPS.load_fast_borrow else op


def _refusal(item: Instr, const: Callable[[Any], int], hooks: Hooks, reason: str) -> list[Instr]:
    return _emit(item, versions.call_with_constants(const(hooks.refuse), [const(reason)])
                 + [(OPS.pop_top, 0)])


def assemble_flavour(written: Written) -> types.CodeType:
    """The written instructions as a code object with the base code's signature."""
    return assemble(written.analysis.code, written.instrs,
                    co_consts=tuple(written.consts.items))


def side_function_code(written: Written, site: Site, side: bool) -> types.CodeType:
    """The code of one side of `site` as a function of `site.live_in` (see the module
    docstring), from the checked flavour `written`."""
    analysis = written.analysis
    code = analysis.code
    consts = written.consts
    start = written.entry[site.sides[side]]
    first = analysis.instrs[site.sides[side]]
    base_depth = analysis.depth[site.jump]
    assert base_depth is not None
    base_depth += versions.stack_effect(analysis.instrs[site.jump].opcode,
                                        analysis.instrs[site.jump].arg, False)

    # The end: where the sides meet, the instruction itself becomes `return locals()`
    # (the join hooks written before it still run: they close `if`s nested in it).
    stop: Optional[Instr] = None
    epilogue: list[Instr] = []
    if site.merge != EXIT:
        stop = written.core[site.merge]
        assert stop is not None
        epilogue = _emit(stop, versions.push_callable(consts.index(builtins.locals))
                         + versions.call(0) + [(OPS.return_value, 0)])

    which = "true" if side else "false"
    return _cut(written, start, first, {stop: epilogue} if stop is not None else {},
                base_depth, list(site.live_in), sorted(site.maybe_unbound_in),
                f"{code.co_name}_if_{site.line}_{which}",
                f"{code.co_qualname}.<if at line {site.line}: {which}>")


def loop_body_code(written: Written, loop: Loop) -> types.CodeType:
    """The code of one iteration of `loop`'s body, then its test, as a function of
    `loop.carried + loop.inputs`: it returns `(test, locals())` where the back site
    would take `bool()` of the test (from the checked flavour `written`)."""
    analysis = written.analysis
    code = analysis.code
    consts = written.consts
    start = written.entry[loop.body]
    first = analysis.instrs[loop.body]
    back = analysis.sites[loop.back]
    base_depth = analysis.depth[back.jump]
    assert base_depth is not None
    base_depth += versions.stack_effect(analysis.instrs[back.jump].opcode,
                                        analysis.instrs[back.jump].arg, False)
    stop = written.forks[loop.back]
    epilogue = _emit(stop, versions.push_callable(consts.index(builtins.locals))
                     + versions.call(0) + [(OPS.build_tuple, 2), (OPS.return_value, 0)])
    return _cut(written, start, first, {stop: epilogue}, base_depth,
                [*loop.carried, *loop.inputs], [],
                f"{code.co_name}_while_{loop.line}_body",
                f"{code.co_qualname}.<while at line {loop.line}: body>")


def _cut(written: Written, start: Instr, first: Instr, stops: dict[Instr, list[Instr]],
         base_depth: int, params: list[str], maybe_unbound: list[str],
         co_name: str, co_qualname: str) -> types.CodeType:
    """A function of `params` running the written code from `start` until one of
    `stops`, which is replaced by its epilogue; the stack below `base_depth` (an
    enclosing loop's iterator) is not there.  `maybe_unbound` parameters are deleted
    first when they come as UNBOUND."""
    code = written.analysis.code
    consts = written.consts
    # What runs: reachable from the side's entry, stopping at the end.
    index = {id(item): k for k, item in enumerate(written.instrs)}
    reach: set[int] = set()
    work = [index[id(start)]]
    while work:
        k = work.pop()
        if k in reach:
            continue
        reach.add(k)
        item = written.instrs[k]
        if item in stops:
            continue
        if item.handler is not None:
            work.append(index[id(item.handler[0])])
        if item.target is not None:
            work.append(index[id(item.target)])
        if item.opcode in OPS.exits or item.opcode in OPS.unconditional_jumps:
            continue
        if k + 1 < len(written.instrs):
            work.append(k + 1)

    # Locals: the side's live-ins are the parameters, in site.live_in order.
    names = list(params)
    body: list[Instr] = []
    copies: dict[int, Instr] = {}
    for k in sorted(reach):
        item = written.instrs[k]
        if item in stops:
            replacement = stops[item]
            copies[id(item)] = replacement[0]
            body.extend(replacement)
            continue
        copy = Instr(item.opcode, item.arg, item.target, item.loc, item.handler, item.flags)
        if item.opcode in (OPS.load_fast, OPS.load_fast_check, OPS.load_fast_and_clear,
                           OPS.store_fast, OPS.delete_fast):
            name = local_name(code, item.arg)
            if name not in names:
                names.append(name)
            copy.arg = names.index(name)
            if copy.opcode == OPS.load_fast and OPS.load_fast_check >= 0:
                copy.opcode = OPS.load_fast_check   # a parameter may have been deleted
        copies[id(item)] = copy
        body.append(copy)
    for copy in body:
        if copy.target is not None:
            copy.target = copies[id(copy.target)]
        if copy.handler is not None:
            handler, depth, lasti = copy.handler
            copy.handler = (copies[id(handler)], depth - base_depth, lasti)

    prologue = [first.like(OPS.resume, 0)]
    for name in maybe_unbound:
        # if name is UNBOUND: del name
        load = first.like(OPS.load_fast, names.index(name))
        check = [load, first.like(OPS.load_const, consts.index(UNBOUND)),
                 first.like(OPS.is_op, 0)]
        delete = first.like(OPS.delete_fast, names.index(name))
        after = first.like(OPS.nop)
        jump = first.like(OPS.pop_jump_if_false, 0, after)
        check.append(jump)
        if OPS.not_taken >= 0:
            check.append(first.like(OPS.not_taken))
        prologue += check + [delete, after]
    enter = first.like(OPS.jump_forward, 0, copies[id(start)])
    instrs = prologue + [enter] + body
    return assemble(
        code, instrs,
        co_consts=tuple(consts.items),
        co_varnames=tuple(names),
        co_argcount=len(params),
        co_posonlyargcount=0,
        co_kwonlyargcount=0,
        co_nlocals=len(names),
        co_cellvars=(),
        co_freevars=(),
        co_flags=CO_OPTIMIZED | CO_NEWLOCALS,
        co_name=co_name,
        co_qualname=co_qualname,
    )
