"""`if` statements on tensors, captured as `torch.cond` from the bytecode.

A forward that branches on a tensor's value (`if x.sum() > 0:`, `if mask.any():`, an
early `return`) stays one graph: the `if` becomes one `torch.ops.higher_order.cond`
node whose two branch graphs are its two sides, each a function of the locals live
into it, producing the locals live where the sides meet (or the return value, when a
side returns).

How (design note).  While a capture records, the C evaluator runs each frame of user
code through its *capture flavour* (`capture_code`, bytecode/instrument.py): the same
instructions with three hooks.  At an `if`:

1. `fork`, before `bool()` of the test.  A tensor test, at an `if` the analysis
   (bytecode/code_graph.py) found convertible: each side is made a function of its
   live locals (the *checked* flavour of the code, entered at that side) and traced
   on fake tensors as `torch.cond` branches are (capture/cond.py), with every frame
   of user code it runs checked for side effects (capture/checked.py).  Both traced:
   one `cond` node; the site is *open* and recording is suspended; `fork` answers the
   outcome as a plain bool.  Anything refused: the reason, and the frame falls back
   exactly as it does without this module (the `bool()` of a tensor is a graph break).
2. The frame then runs the side taken for real, as eager runs it, unrecorded: the
   call's result and side effects are eager's.
3. `join` (or `ret` for a side that returns) where the sides meet: the open site
   closes, recording resumes, and the tensors the side produced (checked against the
   trace: structure, shapes, dtypes) become the `cond` node's outputs; a tensor that
   existed before the `if` is handed back as a fresh alias, so that its other uses
   keep their own node.

Inside a side's trace (a nested `if`), and in a dynamic capture, the test is a fake
tensor: the same happens, the side run after `fork` is the true one, on fakes, and
the outputs are fresh fakes standing for the nested node's results.

Only one site is open at a time: recording is suspended while one is, and nothing is
converted then.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import importlib.metadata as metadata
import importlib.util
import os
import re
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from nnscaler_eval import _C, logs
from nnscaler_eval.bytecode import instrument
from nnscaler_eval.bytecode.code_graph import EXIT, Analysis, Loop, Site
from nnscaler_eval.bytecode.instrument import UNBOUND, Hooks, Written
from nnscaler_eval.bytecode.versions import OPS
from nnscaler_eval.capture import checked, loops
from nnscaler_eval.capture import cond as torch_cond
from nnscaler_eval.capture.data_dependence import has_unbacked_size
from nnscaler_eval.capture.nodes import class_name
from nnscaler_eval.capture.results import Fallback, RecordingAborted
from nnscaler_eval.tracing.locations import is_library_file
from nnscaler_eval.tracing.trace_state import current_tracer
from nnscaler_eval.tracing.tracked_values import _TrackedNumber


@dataclass
class BranchNote:
    """One `if` on a tensor met by a capture: converted, or why not (explain())."""

    filename: str
    lineno: int
    converted: bool
    reason: str = ""
    kind: str = "if"        # or "while"

    def __str__(self) -> str:
        where = f"{self.filename}:{self.lineno}"
        if self.converted:
            return f"{self.kind} at {where}: " + (
                "torch.cond" if self.kind == "if" else "torch.ops.higher_order.while_loop")
        return f"{self.kind} at {where}: not converted ({self.reason})"


# -- per code object: the analysis and what is written from it --------------------------


class CodeBranches:
    """The `if` sites of one base code object and the code written for them.

    Kept in a WeakKeyDictionary keyed by the code: nothing here holds the code object
    or anything that leads to it (a function, its globals), or the entry would never
    die; site hooks reach it through a weak reference."""

    def __init__(self, code: types.CodeType) -> None:
        self.analysis = Analysis(code)
        self.code_ref = weakref.ref(code)
        self.filename = code.co_filename
        self.hooks: dict[int, SiteHook] = {}
        self.merges: dict[int, MergeHook] = {}
        self._written: dict[bool, Written] = {}
        self.sides: dict[tuple[int, bool], types.CodeType] = {}
        self.loop_bodies: dict[int, types.CodeType] = {}
        # The analysis holds the code object: only the facts are kept.
        self.analysis.code = None  # type: ignore[assignment]

    def site_hook(self, site: Site) -> "SiteHook":
        hook = self.hooks.get(site.bool_at)
        if hook is None:
            hook = self.hooks[site.bool_at] = SiteHook(self, site)
        return hook

    def merge_hook(self, merge: int, names: tuple[str, ...]) -> "MergeHook":
        hook = self.merges.get(merge)
        if hook is None:
            hook = self.merges[merge] = MergeHook(merge, names)
        return hook

    def written(self, checked_flavour: bool) -> Written:
        found = self._written.get(checked_flavour)
        if found is None:
            code = self.code_ref()
            if code is None:
                raise RuntimeError("the code object of this `if` is gone")
            self.analysis.code = code
            try:
                found = instrument.write(self.analysis, HOOKS, checked_flavour,
                                         self.site_hook, self.merge_hook)
                # Written.analysis keeps the code only while we assemble.
                self._written[checked_flavour] = found
            finally:
                self.analysis.code = None  # type: ignore[assignment]
        return found

    def assemble(self, checked_flavour: bool) -> types.CodeType:
        code = self.code_ref()
        assert code is not None
        written = self.written(checked_flavour)
        self.analysis.code = code
        try:
            result = instrument.assemble_flavour(written)
        finally:
            self.analysis.code = None  # type: ignore[assignment]
        _C.mark_capture_code(result)
        return result

    def side_code(self, site: Site, side: bool) -> types.CodeType:
        key = (site.bool_at, side)
        found = self.sides.get(key)
        if found is None:
            code = self.code_ref()
            if code is None:
                raise RuntimeError("the code object of this `if` is gone")
            written = self.written(True)
            self.analysis.code = code
            try:
                found = instrument.side_function_code(written, site, side)
            finally:
                self.analysis.code = None  # type: ignore[assignment]
            _C.mark_capture_code(found)
            self.sides[key] = found
        return found


    def loop_body(self, loop: Loop) -> types.CodeType:
        found = self.loop_bodies.get(loop.back)
        if found is None:
            code = self.code_ref()
            if code is None:
                raise RuntimeError("the code object of this `while` is gone")
            written = self.written(True)
            self.analysis.code = code
            try:
                found = instrument.loop_body_code(written, loop)
            finally:
                self.analysis.code = None  # type: ignore[assignment]
            _C.mark_capture_code(found)
            self.loop_bodies[loop.back] = found
        return found


_codes: "weakref.WeakKeyDictionary[types.CodeType, CodeBranches]" = weakref.WeakKeyDictionary()


def code_branches(code: types.CodeType) -> CodeBranches:
    found = _codes.get(code)
    if found is None:
        found = _codes[code] = CodeBranches(code)
    return found


_NOT_PLAIN = 0x20 | 0x80 | 0x100 | 0x200   # generator, coroutine, iterable coroutine, async gen


def capture_code(function: Optional[Any], code: types.CodeType,
                 checked_mode: bool) -> Optional[types.CodeType]:
    """What the C evaluator runs in place of `code` while a capture records
    (csrc/eval_frame.c): its capture flavour, or its checked flavour while a side of a
    converted `if` is traced (`checked_mode`); None: the code as it is (library code,
    or user code without an `if` on a value).  In checked mode, user code that cannot
    be checked is refused (raises: the side is not converted)."""
    if not _user_code(function, code):
        return None
    if not (code.co_flags & 0x1) or not (code.co_flags & 0x2):
        if checked_mode:
            checked.refuse(f"runs a class or module body ({code.co_qualname})")
        return None
    if code.co_flags & _NOT_PLAIN and not (code.co_flags & 0x20 and checked_mode):
        if checked_mode:
            checked.refuse(f"runs the coroutine {code.co_qualname}")
        return None
    if checked_mode and function is None:
        checked.refuse(f"runs {code.co_qualname} without a function object")
    if not checked_mode and not any(i.opcode in _JUMP_OPS for i in _raw(code)):
        return None
    branches = code_branches(code)
    if not checked_mode and not branches.analysis.sites:
        return None
    return branches.assemble(checked_mode)


def _user_code(function: Optional[Any], code: types.CodeType) -> bool:
    """Is `code` the user's (the capture hooks it, a side's trace checks it)?  Code
    made by exec() (`<string>`: a dataclass's generated `__init__`) is its module's:
    the file its function's globals name.  Besides the library files of the rest of
    the project (locations.is_library_file), the packages torch itself requires are
    torch's: torch's ops run them (typing_extensions from torch.fx's schemas)."""
    filename = code.co_filename
    if filename.startswith("<eval_with_key>"):
        return False   # torch.fx's generated code
    if filename.startswith("<") and not filename.startswith(("<frozen", "<nnscaler graph")):
        module_file = getattr(function, "__globals__", {}).get("__file__")
        if isinstance(module_file, str):
            filename = module_file
    return not is_library_file(filename) and not filename.startswith(_torch_requirements())


@functools.lru_cache(maxsize=None)
def _torch_requirements() -> tuple[str, ...]:
    """Where the packages torch's distribution requires live (their top-level modules),
    as its metadata names them."""
    try:
        required = {re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower().replace("_", "-")
                    for r in metadata.requires("torch") or () if "extra ==" not in r}
        tops = metadata.packages_distributions()
    except Exception:    # no metadata (a source build): nothing more is trusted
        return ()
    places: list[str] = []
    for top, dists in tops.items():
        if not any(d.lower().replace("_", "-") in required for d in dists):
            continue
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            places += [os.path.join(p, "") for p in spec.submodule_search_locations]
        elif spec.origin:
            places.append(spec.origin)
    return tuple(places)


def _raw(code: types.CodeType) -> Iterator[Any]:
    return dis.get_instructions(code)


def _jump_ops() -> frozenset[int]:
    return OPS.bool_jumps_if_true | OPS.bool_jumps_if_false


_JUMP_OPS = frozenset()   # filled below (dis opcodes of the conditional jumps)


# -- the hooks the written code calls ----------------------------------------------------


class SiteHook:
    """The `fork` of one `if` site (a bound method of this object is in co_consts)."""

    __slots__ = ("owner", "site", "__weakref__")

    def __init__(self, owner: CodeBranches, site: Site) -> None:
        self.owner = owner
        self.site = site

    def fork(self, test: Any) -> Any:
        tracer = current_tracer()
        if tracer is None or not (isinstance(test, torch.Tensor) or (
                isinstance(test, _TrackedNumber) and getattr(test, "data_dependent", False)
                and test.tracer is tracer)):
            return test
        state: Optional[BranchState] = getattr(tracer, "branches", None)
        if state is None:
            return test
        return state.fork(self, test, sys._getframe(1))


class MergeHook:
    """The `join` at one merge point: `names` are the locals it hands over."""

    __slots__ = ("merge", "names")

    def __init__(self, merge: int, names: tuple[str, ...]) -> None:
        self.merge = merge
        self.names = names

    def join(self, *values: Any) -> tuple[Any, ...]:
        tracer = current_tracer()
        state = getattr(tracer, "branches", None) if tracer is not None else None
        if state is None or state.open is None:
            return values
        return state.join(self, values, sys._getframe(1))


def _ret(value: Any) -> Any:
    tracer = current_tracer()
    state = getattr(tracer, "branches", None) if tracer is not None else None
    if state is None or state.open is None:
        return value
    return state.ret(value, sys._getframe(1))


HOOKS = Hooks(
    fork=lambda site: None,        # made per site (CodeBranches.site_hook)
    join=lambda names: None,
    ret=_ret,
    call=checked.call,
    call_kw=checked.call_kw,
    call_ex=checked.call_ex,
    attr_store=checked.attr_store,
    item_store=checked.item_store,
    inplace=checked.inplace,
    iterate=checked.iterate,
    enter=checked.enter,
    fresh=checked.fresh,
    refuse=checked.refuse,
)


# -- the tracer's side ------------------------------------------------------------------


@dataclass
class OpenSite:
    """A converted `if` whose side taken runs now, unrecorded, in `frame`."""

    hook: SiteHook
    frame: Any
    node: fx.Node
    trace: torch_cond.BranchTrace       # of the side taken (metadata to check against)
    real: bool                          # the side runs on real tensors
    fake_mode: Optional[FakeTensorMode]
    paused: Any                         # the function record, paused meanwhile
    code_mode: int                      # capture_code_mode before
    loop: Optional[Loop] = None         # a converted `while` (its body runs meanwhile)


class BranchState:
    """A tracer's `if`s: the one open now, and what happened to each (explain())."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.open: Optional[OpenSite] = None
        self.notes: list[BranchNote] = []

    def note(self, note: BranchNote) -> None:
        if all((n.filename, n.lineno, n.converted, n.reason, n.kind) !=
               (note.filename, note.lineno, note.converted, note.reason, note.kind)
               for n in self.notes):
            self.notes.append(note)
            # every `if` and `while` on a tensor, converted or not, under "graph"; the
            # refusals under "fallbacks" too
            logs.graph.debug("%s", note)
            if not note.converted:
                logs.fallbacks.debug("%s", note)

    # -- fork ---------------------------------------------------------------------------

    def fork(self, hook: SiteHook, test: Any, frame: Any) -> Any:
        tracer = self.tracer
        if not tracer.recording:
            if isinstance(test, FakeTensor):
                # a side run on fakes after its `if` was traced: any side; a loop on
                # fakes runs no iteration (its results are the node's, bound at the exit)
                return True if hook.site.loop is None else not hook.site.loop.enter
            return test
        site = hook.site
        if site.loop is not None:
            return self._fork_loop(hook, test, frame)
        where = (hook.owner.filename, site.line)
        if site.refusal is not None:
            return self._refuse(test, where, site.refusal)
        if isinstance(test, torch.Tensor):
            with torch._C.DisableTorchFunction():
                elements = test.numel()
            if elements != 1:
                return test   # bool() raises as in eager
        # Our own work runs as written; when the `if` is converted, the side taken
        # does too, until its join restores the mode.
        return self._open(lambda: self._convert(hook, test, frame, where), test, where, "if")

    def _open(self, convert: Callable[[], Any], test: Any, where: tuple[str, int],
              kind: str) -> Any:
        """`convert()`, which turns an `if` or a `while` into its node and opens it, run
        with our own code running as written; the mode is restored on every way out
        but success, where the construct's end restores it (`self.open.code_mode`).  A
        construct that cannot be converted is refused with the reason (inside a side
        being traced, the refusal is that side's); an aborted recording leaves `test`
        to Python."""
        code_mode = _C.capture_code_mode(0)
        try:
            opened = convert()
        except BaseException as exc:
            _C.capture_code_mode(code_mode)
            if isinstance(exc, RecordingAborted):
                return test
            if not isinstance(exc, torch_cond.CondNotCapturable) or \
                    self.tracer.branch is not None:
                raise
            reason = exc.fallback.reason
            if kind == "if":
                reason = reason.removeprefix("torch.cond: ")
            return self._refuse(test, (exc.fallback.filename, exc.fallback.lineno), reason,
                                at=where, kind=kind)
        assert self.open is not None
        self.open.code_mode = code_mode
        self.note(BranchNote(*where, converted=True, kind=kind))
        return opened

    def _refuse(self, test: Any, where: tuple[str, int], reason: str,
                at: Optional[tuple[str, int]] = None, kind: str = "if") -> Any:
        at = at or where
        self.note(BranchNote(*at, converted=False, reason=reason, kind=kind))
        construct = "torch.cond" if kind == "if" else "torch.ops.higher_order.while_loop"
        message = (f"data-dependent control flow: the `{kind}` at line {at[1]} on a tensor "
                   f"is not converted to {construct}: {reason}")
        self.tracer.graph_break(message, where)
        return test

    def _convert(self, hook: SiteHook, test: torch.Tensor, frame: Any,
                 where: tuple[str, int]) -> bool:
        tracer = self.tracer
        site = hook.site
        owner = hook.owner
        local = frame.f_locals
        values = [local[name] if name in local else UNBOUND for name in site.live_in]
        for name, value in zip(site.live_in, values):
            if value is UNBOUND and name not in site.maybe_unbound_in:
                raise torch_cond.CondNotCapturable(Fallback(
                    f"{name!r} is unbound where the `if` starts", *where))

        def refuse(reason: str, location: tuple[str, int] = where) -> torch_cond.CondNotCapturable:
            return torch_cond.CondNotCapturable(Fallback(reason, *location))

        tracer.sync_global_state()
        if isinstance(test, torch.Tensor):
            with torch._C.DisableTorchFunction():
                is_bool = test.dtype == torch.bool
            pred = test if is_bool else test.bool()   # recorded: cond takes a bool
        else:
            pred = test   # a comparison of a data-dependent count: a node of its own
        pred_arg = tracer.graph_arg(pred)
        fake_mode = tracer.fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
        k = next(tracer.branch_names)
        traces = {}
        for side in (True, False):
            function = types.FunctionType(owner.side_code(site, side), frame.f_globals)
            traces[side] = self._trace_side(side, function, values, site, fake_mode, where)
        first, second = traces[True], traces[False]
        if first.out_spec != second.out_spec:
            raise refuse(f"the two sides give different structures ({first.out_spec} vs "
                         f"{second.out_spec})")
        if first.tensor_leaves != second.tensor_leaves:
            position = min(set(first.tensor_leaves) ^ set(second.tensor_leaves))
            kinds = [("a tensor" if position in t.tensor_leaves else
                      f"a {type(t.constants.get(position)).__name__}") for t in (first, second)]
            raise refuse(f"the two sides give different structures ({kinds[0]} vs {kinds[1]} "
                         f"for {_output_name(site, first.out_spec, position)})")
        for position, value in first.constants.items():
            other = second.constants.get(position)
            if not _same_constant(value, other):
                raise refuse(f"the two sides give different Python values "
                             f"({_describe(value)} vs {_describe(other)}) for "
                             f"{_output_name(site, first.out_spec, position)}")
        for i, (a, b) in enumerate(zip(first.out_meta, second.out_meta)):
            if a[:3] != b[:3]:
                raise refuse(f"output {i} differs between the sides: {a[:3]} vs {b[:3]}")

        lifted: dict[fx.Node, Any] = dict(first.frame.lifted_values)
        for node, value in second.frame.lifted_values.items():
            lifted.setdefault(node, value)
        modules = [trace.finish(0, list(lifted), class_name(f"{name}_graph_{k}"))
                   for trace, name in ((first, "true"), (second, "false"))]
        attrs = [torch_cond._branch_attr(tracer, f"{name}_graph_{k}", gm)
                 for name, gm in zip(("true", "false"), modules)]
        node = tracer.create_node("call_function", torch.ops.higher_order.cond,
                                  (pred_arg, attrs[0], attrs[1], tuple(lifted)), {})
        node.meta["nnscaler_if"] = {"line": site.line, "ifexpr_ok": not site.calls,
                                    "converted_from": "bytecode"}
        real = tracer.branch is None and tracer.symbolic is None
        if isinstance(pred, _TrackedNumber):
            taken = bool(pred.plain)
        elif real:
            with torch._C.DisableTorchFunction():
                taken = bool(pred)
        else:
            taken = True
        # The side taken runs unrecorded, as written; capture_code_mode is 0 already
        # (fork), and what fork restores is what the join restores.
        self.open = OpenSite(hook, frame, node, traces[taken], real, fake_mode,
                             _C.record_functions_pause(), -1)
        tracer._suspended += 1
        return taken

    def _trace_side(self, side: bool, function: Callable[..., Any], values: list[Any],
                    site: Site, fake_mode: FakeTensorMode,
                    where: tuple[str, int]) -> torch_cond.BranchTrace:
        tracer = self.tracer
        record = checked.SideRecord()
        previous_record = checked.set_record(record)
        open_before, suspended_before = self.open, tracer._suspended
        which = "true" if side else "false"

        def run() -> Any:
            # Frames the side starts run as checked code (capture/checked.py).
            side_mode = _C.capture_code_mode(2)
            try:
                result = function(*values)
            except checked.BranchRefused as exc:
                raise torch_cond.CondNotCapturable(Fallback(
                    f"the {which} side {exc.reason}", *exc.location)) from None
            finally:
                _C.capture_code_mode(side_mode)
            if record.refusal is not None:   # swallowed by the side's own `except:`
                raise torch_cond.CondNotCapturable(Fallback(
                    f"the {which} side {record.refusal.reason}", *record.refusal.location))
            if site.merge == EXIT:
                return result
            return tuple(result.get(name, UNBOUND) for name in site.live_out)

        try:
            trace = torch_cond._trace_branch(tracer, which, run, [], pytree.tree_flatten(())[1],
                                             fake_mode, where, constants=True,
                                             name=f"side of the `if` at line {site.line}")
        finally:
            self._close_abandoned(open_before, suspended_before)
            checked.set_record(previous_record)
        for position, value in trace.constants.items():
            if value is UNBOUND:
                raise torch_cond.CondNotCapturable(Fallback(
                    f"the {which} side leaves {_output_name(site, trace.out_spec, position)} "
                    "unbound", *where))
        if any(has_unbacked_size(list(meta[0])) for meta in trace.out_meta):
            raise torch_cond.CondNotCapturable(Fallback(
                f"the {which} side makes an output whose shape depends on tensor values",
                *where))
        return trace

    def _close_abandoned(self, open_before: Optional[OpenSite], suspended: int) -> None:
        """A side's trace ended (maybe by an exception) with a nested site still open:
        close it, so that recording goes on as before the side."""
        if self.open is not open_before and self.open is not None:
            _C.capture_code_mode(self.open.code_mode)
            _C.record_functions_resume(self.open.paused)
            self.open = open_before
        self.tracer._suspended = suspended

    # -- `while` loops ------------------------------------------------------------------

    def _fork_loop(self, hook: SiteHook, test: Any, frame: Any) -> Any:
        """The first test of a `while` loop on a tensor: the whole loop becomes one
        while_loop node, or falls back with the reason."""
        loop = hook.site.loop
        assert loop is not None
        where = (hook.owner.filename, loop.line)
        if loop.refusal is not None:
            return self._refuse(test, where, loop.refusal, kind="while")
        if not isinstance(test, torch.Tensor):
            return self._refuse(test, where, "its test is a Python number computed from "
                                "tensor data", kind="while")
        with torch._C.DisableTorchFunction():
            if test.numel() != 1:
                return test   # bool() raises as in eager
        return self._open(lambda: self._convert_loop(hook, loop, test, frame, where), test,
                          where, "while")

    def _convert_loop(self, hook: SiteHook, loop: Loop, test: torch.Tensor, frame: Any,
                      where: tuple[str, int]) -> bool:
        tracer = self.tracer

        def refuse(reason: str, location: tuple[str, int] = where) -> torch_cond.CondNotCapturable:
            return torch_cond.CondNotCapturable(Fallback(reason, *location))

        local = frame.f_locals
        for name in (*loop.carried, *loop.inputs):
            if name not in local:
                raise refuse(f"{name!r} is unbound where the loop starts")
        carried = [local[name] for name in loop.carried]
        inputs = [local[name] for name in loop.inputs]
        for name, value in zip(loop.carried, carried):
            if not isinstance(value, torch.Tensor):
                raise refuse(f"it carries {name!r}, a {type(value).__name__}: only tensors "
                             "can change from one iteration to the next")
        tracer.sync_global_state()
        pred = _predicate(test)               # recorded: while_loop carries a bool scalar
        args = [tracer.graph_arg(value) for value in (pred, *carried)]
        fake_mode = tracer.fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
        k = next(tracer.branch_names)
        function = types.FunctionType(hook.owner.loop_body(loop), frame.f_globals)
        trace = self._trace_loop_body(function, loop, [pred, *carried], inputs, fake_mode,
                                      where)
        with torch._C.DisableTorchFunction():
            before = [torch_cond._tensor_meta(t) for t in carried]
        names = [repr(n) for n in loop.carried]
        reason = loops.changed_carry(names, before, trace.out_meta[1:])
        if reason is not None:
            raise refuse(reason)
        if loops.unbacked_output(trace.out_meta):
            raise refuse("the body makes a value whose shape depends on tensor values")
        lifted = dict(trace.frame.lifted_values)
        n = 1 + len(carried)
        body_gm = loops.unaliased(trace.finish(n, list(lifted),
                                               class_name(f"while_body_graph_{k}")))
        cond_gm = loops.first_input_graph(n + len(lifted), f"while_cond_graph_{k}")
        node = loops.make_node(tracer, cond_gm, body_gm, k, args, list(lifted))
        node.meta["nnscaler_while"] = {"line": loop.line, "converted_from": "bytecode"}
        real = tracer.branch is None and tracer.symbolic is None
        if real:
            with torch._C.DisableTorchFunction():
                taken = bool(pred)
        else:
            taken = False   # on fakes: no iteration runs; the exit binds the results
        self.open = OpenSite(hook, frame, node, trace, real, fake_mode,
                             _C.record_functions_pause(), -1, loop)
        tracer._suspended += 1
        return taken if loop.enter else not taken

    def _trace_loop_body(self, function: Callable[..., Any], loop: Loop, leaves: list[Any],
                         inputs: list[Any], fake_mode: FakeTensorMode,
                         where: tuple[str, int]) -> torch_cond.BranchTrace:
        tracer = self.tracer
        record = checked.SideRecord()
        previous_record = checked.set_record(record)
        open_before, suspended_before = self.open, tracer._suspended

        def run(pred: Any, *carried: Any) -> Any:
            # Frames the side starts run as checked code (capture/checked.py).
            side_mode = _C.capture_code_mode(2)
            try:
                test, env = function(*carried, *inputs)
            except checked.BranchRefused as exc:
                raise torch_cond.CondNotCapturable(Fallback(
                    f"the loop body {exc.reason}", *exc.location)) from None
            finally:
                _C.capture_code_mode(side_mode)
            if record.refusal is not None:
                raise torch_cond.CondNotCapturable(Fallback(
                    f"the loop body {record.refusal.reason}", *record.refusal.location))
            if not isinstance(test, torch.Tensor) or test.numel() != 1:
                raise torch_cond.CondNotCapturable(Fallback(
                    "the test gives no one-element tensor after an iteration", *where))
            out = [_predicate(test)]
            for name in loop.carried:
                value = env.get(name, UNBOUND)
                if not isinstance(value, torch.Tensor):
                    raise torch_cond.CondNotCapturable(Fallback(
                        f"an iteration leaves {name!r} a {type(value).__name__}: only "
                        "tensors can change from one iteration to the next", *where))
                out.append(value)
            return tuple(out)

        try:
            return torch_cond._trace_branch(
                tracer, "body", run, leaves, pytree.tree_flatten(tuple(leaves))[1],
                fake_mode, where, name=f"body of the `while` at line {loop.line}")
        finally:
            self._close_abandoned(open_before, suspended_before)
            checked.set_record(previous_record)

    def _bind_loop(self, opened: OpenSite, produced: tuple[Any, ...]) -> Any:
        tracer = self.tracer
        if tracer.fallback is not None:
            return None
        loop = opened.loop
        assert loop is not None
        metas = opened.trace.out_meta[1:]
        where = (opened.hook.owner.filename, loop.line)
        bound = _results(tracer, opened, produced, metas,
                         f"the `while` loop at line {loop.line}", where)
        if bound is None:
            return None
        tracer.nodes.bind_result((None, *bound), opened.node, dynamic=None)
        return tuple(bound)

    # -- join / ret ---------------------------------------------------------------------

    def join(self, merge: MergeHook, values: tuple[Any, ...], frame: Any) -> tuple[Any, ...]:
        opened = self.open
        if opened is None or opened.frame is not frame:
            return values
        if opened.loop is not None:
            if merge.merge not in opened.loop.exits:
                return values
            carried = opened.loop.carried
            produced = self._close(tuple(values[merge.names.index(n)] for n in carried))
            if produced is None:
                return values
            out = list(values)
            for name, value in zip(carried, produced):
                out[merge.names.index(name)] = value
            return tuple(out)
        if opened.hook.site.merge != merge.merge:
            return values
        site = opened.hook.site
        picked = tuple(values[merge.names.index(name)] for name in site.live_out)
        produced = self._close(picked)
        if produced is None:
            return values
        out = list(values)
        for name, value in zip(site.live_out, produced):
            out[merge.names.index(name)] = value
        return tuple(out)

    def ret(self, value: Any, frame: Any) -> Any:
        opened = self.open
        if opened is None or opened.frame is not frame or opened.hook.site.merge != EXIT \
                or opened.loop is not None:
            return value
        produced = self._close(value)
        return value if produced is None else produced

    def _close(self, produced: Any) -> Any:
        """The open site's side has run: resume recording and bind what it produced to
        the node's outputs.  Returns the values to carry on with (None: unchanged)."""
        opened = self.open
        assert opened is not None
        self.open = None
        _C.record_functions_resume(opened.paused)
        self.tracer._suspended -= 1
        try:
            if opened.loop is not None:
                return self._bind_loop(opened, produced)
            return self._bind(opened, produced)
        finally:
            _C.capture_code_mode(opened.code_mode)   # as before the `if` (mode 0 until here)

    def _bind(self, opened: OpenSite, produced: Any) -> Any:
        tracer = self.tracer
        if tracer.fallback is not None:
            return None
        trace = opened.trace
        leaves, spec = pytree.tree_flatten(produced)
        where = (opened.hook.owner.filename, opened.hook.site.line)
        if spec != trace.out_spec:
            tracer.graph_break(f"the side of the `if` at line {where[1]} produced "
                               f"{spec}, not what its trace produced", where)
            return None
        tensors = []
        for position in trace.tensor_leaves:
            tensors.append(leaves[position])
        bound = _results(tracer, opened, tensors, trace.out_meta,
                         f"the side of the `if` at line {where[1]}", where)
        if bound is None:
            return None
        tracer.nodes.bind_result(tuple(bound), opened.node, dynamic=None)
        for position, tensor in zip(trace.tensor_leaves, bound):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, spec)

    def finish(self) -> None:
        """The run ended: a site still open means its side raised and the exception
        was caught outside it; what ran since was not recorded."""
        opened = self.open
        if opened is None:
            return
        self.open = None
        _C.capture_code_mode(opened.code_mode)
        _C.record_functions_resume(opened.paused)
        self.tracer._suspended -= 1
        where = (opened.hook.owner.filename, opened.hook.site.line)
        what = (f"the `while` loop at line {opened.loop.line}" if opened.loop is not None
                else f"the side of the `if` at line {where[1]}")
        self.tracer.graph_break(f"{what} raised", where)


def _predicate(test: torch.Tensor) -> torch.Tensor:
    """A one-element test as while_loop carries it: a bool tensor with no dimensions
    (ops recorded in the graph being built)."""
    with torch._C.DisableTorchFunction():
        is_bool, shape = test.dtype == torch.bool, tuple(test.shape)
    pred = test if is_bool else test.bool()
    return pred if shape == () else pred.reshape(())


def _same_constant(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (bool, int, float, complex, str, bytes, type(None), torch.dtype,
                      torch.device, torch.Size, torch.layout, torch.memory_format)):
        return bool(a == b)
    return False


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def _output_name(site: Site, spec: pytree.TreeSpec, position: int) -> str:
    if site.merge == EXIT:
        return "the return value"
    # positions count leaves; name the variable whose subtree holds it
    count = 0
    for name, child in zip(site.live_out, spec.children()):
        count += child.num_leaves
        if position < count:
            return repr(name)
    return "a value"


_JUMP_OPS = _jump_ops()


def _results(tracer: Any, opened: Any, produced: list, metas: list, construct: str,
             where: tuple) -> Optional[list]:
    """The tensors a converted `if` side or `while` loop hands on, to be bound to its
    node: in a real run, what ran (checked against its trace's metadata; an alias
    where the value is already another node's); on fakes, fresh fakes of the traced
    metadata.  None after a graph break (it ran differently from its trace)."""
    if opened.real:
        with torch._C.DisableTorchFunction():
            for tensor, meta in zip(produced, metas):
                if not isinstance(tensor, torch.Tensor) or \
                        torch_cond._tensor_meta(tensor)[:3] != meta[:3]:
                    tracer.graph_break(f"{construct} ran differently from its trace", where)
                    return None
        bound = []
        for tensor in produced:
            if tracer.nodes.known(tensor) is not None:
                with tracer.suspended():
                    tensor = tensor.view_as(tensor)
            bound.append(tensor)
        return bound
    with torch._C.DisableTorchFunction(), contextlib.ExitStack() as stack:
        if opened.fake_mode is not None:
            stack.enter_context(opened.fake_mode)
        bound = [torch_cond._fresh_fake(meta) for meta in metas]
        return [t.clone() if t.requires_grad else t for t in bound]
