"""The Tracer: a `TorchFunctionMode` that records one real run of a forward.

It drives the other modules of the package (see its docstring): each torch call is
run, classified (calls) and written as a node whose arguments are the nodes of the
values it took (nodes); module calls, `module.training` reads and state writes come
in through trace_patches' protocol (training); torch.cond goes to cond; grad mode and
autocast are synced before each node (global_state); the result becomes the graph's
output and the Capture (output).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import sys
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx as fx
from torch.fx import _lazy_graph_module
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

from nnscaler_eval import _C
from nnscaler_eval.runners import direct_calls, module_calls
from nnscaler_eval.tracing import trace_patches
from nnscaler_eval.capture import calls, hook_nodes, output, passed_objects, signals, unwinding
from nnscaler_eval.capture.branches import BranchState
from nnscaler_eval.capture.data_dependence import DataDependence, has_unbacked_size
from nnscaler_eval.capture.python_values import DATA_VALUES, TRACKED_SEQUENCES, PythonValues
from nnscaler_eval.capture import dynamic as symbolic_shapes
from nnscaler_eval.capture import cond as torch_cond
from nnscaler_eval.capture import loops
from nnscaler_eval.tracing.compile_awareness import eager_answers
from nnscaler_eval.capture.calls import LITERAL_TYPES, OPERATORS, qualname, tensors_in
from nnscaler_eval.capture.global_state import GlobalState
from nnscaler_eval.capture.inputs import hidden_tensors, hidden_tensors_reason, holds_tensor, key_suffix
from nnscaler_eval.tracing.locations import is_library_file, record_source, user_location
from nnscaler_eval.capture.nodes import NodeMap
from nnscaler_eval.capture.results import Capture, Fallback, GraphBreakError, RecordingAborted
from nnscaler_eval.guarding.keyed_objects import is_keyed
from nnscaler_eval.capture.training import (
    MISSING_VALUE,
    TrackedModules,
    deps_of,
    deps_of_args,
    global_hook_state,
    is_number,
    is_plain,
    same_tensor_kind,
    tracked,
    tree_entry,
    unique_modules,
    writes_nothing_new,
)
from nnscaler_eval.runners.codegen import InputPath, OutputLayout
from nnscaler_eval.runtime import ifexpr
from nnscaler_eval.tracing.trace_state import current_tracer, run_to_completion, set_current_tracer
from nnscaler_eval.tracing.tracked_values import TrainingFlag, _TrackedNumber, plain_value, quiet_plain


def capture(
    fn: Callable[..., Any],
    slots: tuple[Any, ...],
    slot_names: tuple[str, ...],
    *,
    root: Optional[nn.Module],
    fullgraph: bool = False,
    call: Optional[Callable[[], Any]] = None,
    symbolic: Optional[symbolic_shapes.SymbolicInputs] = None,
    rebuild_objects: bool = False,
    python_values: bool = False,
) -> Capture:
    """Run `fn` once for real on `slots`, recording it; see the package docstring.

    `call` runs fn with the slots correctly rebound (needed when the code has `*args` /
    `**kwargs`); without it, `fn(*slots)`. An exception raised by the forward
    propagates unchanged, after every patch and `training` attribute is restored.

    With `symbolic` (capture/dynamic.py) the slots hold its fake arguments and the run
    is on fakes: sizes become expressions in the graph, and anything the trace cannot
    follow symbolically raises `dynamic.Unsupported` at once (nothing runs for real).
    `rebuild_objects`: a KV cache the forward returns is built anew by the runner on
    every call (output.rebuildable); export has no such runner and refuses it.
    `python_values` (export for nnScaler): the numbers, shapes and dicts that flow
    from the inputs are graph values (capture/python_values.py); the forward is then
    called with the slots as the tracer wrapped them (`call` must be None).
    """
    tracer = Tracer(fn, tuple(slots), tuple(slot_names), root=root, fullgraph=fullgraph,
                    symbolic=symbolic)
    tracer.rebuild_objects = rebuild_objects
    if python_values:
        tracer.python_values = PythonValues(tracer)
        return tracer.run(tracer.call_with_slots)
    return tracer.run(call if call is not None else (lambda: fn(*slots)))


def _names_literally(code: Any, name: str) -> bool:
    """`code` names `name` (an attribute it stores, or a string constant)."""
    return name in code.co_names or name in code.co_consts


def _pop_modes_to(depth: int) -> None:
    """Pop torch function modes until `depth` are left (idempotent)."""
    while torch._C._len_torch_function_stack() > depth:
        torch._C._pop_torch_function_stack()


def _pop_dispatch_modes_to(depth: int) -> None:
    """Pop torch dispatch modes until `depth` are left (idempotent; the `with` that
    pushed ours may not have run its exit when an interrupt landed)."""
    while torch._C._len_torch_dispatch_stack() > depth:
        torch._C._pop_torch_dispatch_stack(None)


class _OpaqueWitness:
    """The data-dependence record of one opaque call (Tracer._witnessed)."""

    def __init__(self, watch: Optional[DataDependence]) -> None:
        self.watch = watch
        self.record = watch.begin() if watch is not None else None

    def close(self) -> None:
        if self.watch is not None and self.record is not None:
            self.watch.close(self.record)

    def verdict(self, result: Any) -> Optional[str]:
        if self.watch is None or self.record is None:   # a run on fakes
            return ("an opaque call made an output whose shape depends on tensor data"
                    if has_unbacked_size(result) else None)
        return self.watch.verdict(self.record, result=result)


class Tracer(TorchFunctionMode):
    """Records one real run of a forward into an fx graph (see the package docstring).

    What it composes: `nodes` (which node stands for each value), `modules` (training
    flags and module state), `global_state` (grad mode and autocast as the graph has
    them). Inside a torch.cond branch `graph`, `branch`, `fake_mode` and
    `global_state` are the branch's (cond swaps them).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        slots: tuple[Any, ...],
        slot_names: tuple[str, ...],
        *,
        root: Optional[nn.Module],
        fullgraph: bool,
        symbolic: Optional[symbolic_shapes.SymbolicInputs] = None,
    ) -> None:
        super().__init__()
        self.symbolic = symbolic
        self.rebuild_objects = False   # capture() sets it
        if len(slots) != len(slot_names):
            raise ValueError(f"{len(slots)} slots but {len(slot_names)} slot names")
        self.fn = fn
        self.slots = slots
        self.slot_names = slot_names
        self.root = root
        self.fullgraph = fullgraph
        self.graph = fx.Graph()  # the graph being recorded into (a cond branch's, inside one)
        self.root_graph = self.graph
        self.fallback: Optional[Fallback] = None
        # Inside a torch.cond branch: its frame, and the fake mode its values live in.
        self.branch: Optional[torch_cond.BranchFrame] = None
        self.fake_mode: Optional[FakeTensorMode] = symbolic.fake_mode if symbolic else None
        self.branch_names = itertools.count()
        self._suspended = 0
        # `if` statements on tensors, converted to torch.cond (capture/branches.py)
        self.branches = BranchState(self)
        self._code_mode: Optional[int] = None   # capture_code_mode before run()
        self._hooked_before: set[int] = set()   # modules with forward hooks (_prepare)

        self.nodes = NodeMap(self.root_graph, root)
        self.modules = TrackedModules(self)
        self.read_metadata = False
        # Tensors whose metadata Python read that no node of the graph stands for (a
        # parameter read only for its shape or dtype): their metadata shaped the graph
        # as constants, so the entry guards it (if they are module state).
        self.metadata_tensors: dict[int, torch.Tensor] = {}
        self.unproven_constants: dict[int, torch.Tensor] = {}
        self.global_state = GlobalState()
        # Which ops make shapes from tensor values: a static capture's run is watched
        # at the dispatch level (a symbolic one runs on fakes: unbacked sizes say it).
        # One per thread: a capture nested in another's (a compiled submodule run
        # opaque) shares it, so that one mode sees each op, whatever the nesting.
        self.data_dependence = DataDependence.of_this_thread() if symbolic is None else None
        # Numbers, shapes and dicts from the inputs as graph values (export for
        # nnScaler; capture() sets it).
        self.python_values: Optional[PythonValues] = None
        # A submodule run opaque while its node is made, as (path, class): the last
        # entry of that node's `nn_module_stack` (python_values only).
        self.module_stack: list[tuple[str, type]] = []
        # Submodule calls traced inline in a static capture, as (path, class, forward's
        # code), and the indices of those running now: each node made meanwhile
        # carries them (`meta["nnscaler_calls"]`, runners/block_reuse.py).
        self.inline_calls: list[tuple[Optional[str], type, Any]] = []
        self._call_stack: tuple[int, ...] = ()

    # -- state -----------------------------------------------------------------

    @property
    def recording(self) -> bool:
        return self.fallback is None and self._suspended == 0

    def graph_break(self, reason: str, location: Optional[tuple[str, int]] = None) -> None:
        """End the capture: record why (first reason wins), or raise with fullgraph."""
        if self.fallback is not None:
            return
        filename, lineno = location if location is not None else user_location()
        if self.symbolic is not None:
            # A dynamic capture is complete or not used: stop before anything more
            # runs on fakes (convert_frame captures the call statically instead).
            self.fallback = Fallback(reason, filename, lineno)
            raise symbolic_shapes.Unsupported(f"{reason} ({filename}:{lineno})")
        if self.branch is not None:
            # Stop tracing the branch now (it runs on fake tensors; nothing is lost):
            # trace_cond turns this into the frame's fallback, or its parent branch's.
            fallback = Fallback(f"in a torch.cond branch: {reason}", filename, lineno)
            raise torch_cond.CondNotCapturable(fallback)
        self.fallback = Fallback(reason, filename, lineno)
        if self.fullgraph:
            raise GraphBreakError(self.fallback)
        # From here on the run is plain eager: give modules their real flags back.
        self.modules.restore_training()

    @contextlib.contextmanager
    def suspended(self, modules: tuple[nn.Module, ...] = ()) -> Iterator[None]:
        """Run code for real without recording it (opaque modules, register_op ops).

        `modules` get their real `training` values back meanwhile, so flags do not
        leak into code that is not being recorded.
        """
        self._suspended += 1
        hidden = self.modules.hide(modules)
        # Code run for real here shapes no graph: the functions it runs are not
        # recorded for value guards (a hook appending to a list would otherwise be
        # guarded and recapture on every call), and runs as it is written.
        paused = _C.record_functions_pause()
        code_mode = _C.capture_code_mode(0)
        try:
            yield
        finally:
            _C.capture_code_mode(code_mode)
            _C.record_functions_resume(paused)
            if self.fallback is None:
                self.modules.unhide(hidden)
            self._suspended -= 1

    def _unrecorded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, recording nothing: a recorded op's own implementation
        (the autograd.Function inside a `torch.library` custom op, its reruns on fakes)
        is inside the op's node, not a call of the forward's beside it."""
        self._suspended += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._suspended -= 1

    # -- the run -----------------------------------------------------------------

    def run(self, call: Callable[[], Any]) -> Capture:
        """Trace `call()` once; the process is as before afterwards, however it ends.

        An asynchronous exception (KeyboardInterrupt from a signal handler) may land
        between any two bytecodes, in here, in the patches, in the user's forward or in
        a `finally`. So every step that changes process state is undone by one
        idempotent `_leave()`, run in the outer `finally` and run again if an interrupt
        lands inside it: no patch, no current tracer, no mode of ours on the torch
        function stack, nothing of the trace pinned.
        """
        previous = current_tracer()
        mode_depth = torch._C._len_torch_function_stack()
        dispatch_depth = torch._C._len_torch_dispatch_stack()
        lazy_flag = _lazy_graph_module._use_lazy_graph_module_flag
        global_hooks = global_hook_state()
        deferral = signals.Deferral()
        try:
            deferral.start()
            set_current_tracer(self)
            trace_patches.install(self)
            # Frames of user code run with their `if`s hooked (capture/branches.py).
            self._code_mode = _C.capture_code_mode(1)
            self._prepare()
            # `with self:`, except that leaving pops down to the entry depth: an
            # interrupt inside `_pop_mode_temporarily` can leave our mode popped
            # already, and a plain pop would then fail or pop somebody else's.
            torch._C._push_on_torch_function_stack(self)
            try:
                with contextlib.ExitStack() as modes:
                    if self.symbolic is not None:
                        modes.enter_context(self.symbolic.active())
                    elif not self.data_dependence.on_stack():
                        modes.enter_context(self.data_dependence)
                        modes.callback(self.data_dependence.forget)
                    # No garbage collection runs meanwhile: what one runs (gc
                    # callbacks, finalizers of cyclic garbage) is not the forward's
                    # (tracing/asynchronous.py).
                    result = _C.call_without_collections(call)
            finally:
                _pop_modes_to(mode_depth)
                _pop_dispatch_modes_to(dispatch_depth)
            self.branches.finish()
            self._check_module_state()
            layout = self._record_output(result) if self.fallback is None else None
            self._leave(previous, mode_depth, dispatch_depth)
            capture = self._make_capture(result, layout)
            capture.state_unchanged = self.modules.unchanged_check(global_hooks)  # type: ignore[attr-defined]
            return capture
        finally:
            run_to_completion(self._leave, previous, mode_depth, dispatch_depth, lazy_flag,
                              True)
            # Last, with everything put back: a signal noted during the trace.
            deferral.stop()

    def _leave(
        self, previous: Any, mode_depth: int, dispatch_depth: int, lazy_flag: Any = None,
        final: bool = False
    ) -> None:
        """Undo what run() did to the process; each step idempotent."""
        if self.python_values is not None:
            self.python_values.restore()
        self.modules.restore_training()
        if self._code_mode is not None:
            _C.capture_code_mode(self._code_mode)
            self._code_mode = None
        trace_patches.uninstall(self)
        # Modes pushed above run()'s entry depth (ours, or one an interrupt left).
        _pop_modes_to(mode_depth)
        _pop_dispatch_modes_to(dispatch_depth)
        if current_tracer() is self:
            set_current_tracer(previous)
        if lazy_flag is not None:
            _lazy_graph_module._use_lazy_graph_module_flag = lazy_flag
        if final:
            # An exception's traceback may keep this tracer alive: not its tensors. And
            # the tracer is cyclic garbage once the capture is made (its flags name it):
            # it must not hold the modules or the call's arguments until the next
            # cyclic collection (`del model` frees a compiled model at once, as eager).
            self.nodes.forget()
            self.modules.forget()
            self.slots = ()
            self.fn = self.root = None

    def _prepare(self) -> None:
        # Which modules have forward hooks before the forward runs (a forward that
        # installs its own, lazily, has them followed from its next call).
        self._hooked_before = (
            {id(m) for m in self.root.modules() if m._forward_hooks}
            if isinstance(self.root, nn.Module) else set())
        # Placeholders: every tensor leaf of the slots.
        # KV caches passed in: their tensors are placeholders too, and what the
        # forward writes into them is replayed (passed_objects).
        self.passed = (passed_objects.ObjectSnapshot(self.slots) if self.rebuild_objects
                       else None)
        for index, (slot, slot_name) in enumerate(zip(self.slots, self.slot_names)):
            leaves = (passed_objects.input_leaves(slot) if self.passed
                      else pytree.tree_flatten_with_path(slot)[0])
            for keys, leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    name = slot_name + "".join(key_suffix(k) for k in keys)
                    node = self.nodes.placeholder(name, leaf)
                    node.meta["nnscaler_input"] = InputPath(index, tuple(keys))
                    if id(leaf) not in self.nodes.tensor_nodes:
                        self.nodes.map(leaf, node)
                elif hidden_tensors(leaf) or (is_keyed(leaf) and holds_tensor(leaf)):
                    # (a KV cache is looked into only where the runner replays what
                    # the forward writes into it: not for export)
                    self.graph_break(hidden_tensors_reason(slot_name, leaf),
                                     location=self._forward_location())
                    return
        if self.python_values is not None:
            # Not `**kwargs`: nnScaler keeps it as it is and leaves what a forward reads
            # from it undefined (its code generator cannot read from it): its values
            # are this run's, as nnScaler's own trace takes them.
            kwargs_slot = (len(self.slots) - 1 if self.fn is not None and
                           self.fn.__code__.co_flags & inspect.CO_VARKEYWORDS else -1)
            self.slots = tuple(
                self.python_values.inputs(slot, name, index, self._input_placeholder)
                if (index > 0 or self.root is None) and index != kwargs_slot else slot
                for index, (slot, name) in enumerate(zip(self.slots, self.slot_names)))
        if self.symbolic is not None:
            # Symbolic int and float arguments are graph inputs (after the tensors).
            first = len(self.slots) - len(self.symbolic.values)
            for index, keys, symbol in self.symbolic.scalar_inputs:
                name = self.slot_names[first + index] + "".join(key_suffix(k) for k in keys)
                node = self.nodes.placeholder(name, self.symbolic.hint(symbol))
                node.meta["nnscaler_input"] = InputPath(first + index, keys)
                self.symbolic.symbol_nodes[symbol] = node
        # Flags for the whole tree, not only for the modules called: a parent may read
        # a child's flag (`if self.block.training:`) without calling it.
        if self.root is not None:
            for module in self.root.modules():
                self._swap_training(module)
            self._visit(self.root)

    def _input_placeholder(self, name: str, example: Any, index: int, keys: tuple) -> fx.Node:
        node = self.nodes.placeholder(name, example)
        node.meta["nnscaler_input"] = InputPath(index, tuple(keys))
        return node

    def call_with_slots(self) -> Any:
        """The forward called with `self.slots`, bound as CPython bound them: the
        positional ones, `*args` spread, keyword-only ones and `**kwargs` by name."""
        code = self.fn.__code__
        positional = list(self.slots[: code.co_argcount])
        at = code.co_argcount
        kwonly = dict(zip(code.co_varnames[at: at + code.co_kwonlyargcount],
                          self.slots[at: at + code.co_kwonlyargcount]))
        at += code.co_kwonlyargcount
        if code.co_flags & inspect.CO_VARARGS:
            positional += list(self.slots[at])
            at += 1
        if code.co_flags & inspect.CO_VARKEYWORDS:
            kwonly.update(self.slots[at])
        return self.fn(*positional, **kwonly)

    def _forward_location(self) -> tuple[str, int]:
        code = getattr(self.fn, "__code__", None)
        if code is None:
            return "<unknown>", 0
        return code.co_filename, code.co_firstlineno

    # -- training flags and module state (kept by self.modules) -----------------------

    def _swap_training(self, module: nn.Module) -> None:
        if self.fallback is None:  # once fallen back, no module gets a flag
            self.modules.swap_training(module)

    def _visit(self, module: nn.Module) -> None:
        self.modules.visit(module, swap=self.fallback is None)

    def read_training(self, module: nn.Module, value: Any) -> Any:
        """`module.training` on this thread (trace_patches' descriptor): its flag while
        this trace records it, else `value`, the real `__dict__` entry."""
        return self.modules.read_training(module, value)

    def _check_module_state(self) -> None:
        """Catch state writes the `__setattr__` patch cannot see (`object.__setattr__`,
        `__dict__` updates, mutated attribute containers)."""
        if self.fallback is not None:
            return
        changed = self.modules.changed()
        if changed is not None:
            module, name = changed
            self.graph_break(
                f"write to module state: {type(module).__name__}.{name} changed "
                "during forward",
                location=self._forward_location(),
            )
        elif self.modules.writes and self.modules.opaque:
            # The runner replays the writes after the graph; a module run for real
            # inside it (hooks) could read the attribute in between.
            _, name, _, _ = next(iter(self.modules.writes.values()))
            self.graph_break(
                f"write to module state: {name!r} is written in a forward that also "
                "runs a module with hooks",
                location=self._forward_location(),
            )
            if self.fallback is not None and any(
                    before is MISSING_VALUE for _, _, before, _ in self.modules.writes.values()):
                # An attribute set for the first time is lazy set-up (transformers marks
                # a model whose output-capturing hooks it has just installed): done
                # once, so a fallback kept for it would hold every later call eager.
                self.fallback.retry = True
                # The hooks this forward installed are its own (output capturing):
                # followed from the next capture, which then need not fail first
                # on a tensor they hand out (hook_nodes).
                hook_nodes.escaped({key: module for key, module in self.modules.opaque.items()
                                    if key not in self._hooked_before})

    # -- callbacks from trace_patches, runtime.ifexpr, register_op --------------

    def on_module_call(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if signals.pending():
            signals.deliver()
        self._visit(module)
        if calls.runs_opaque(module) and self.symbolic is None and self.branch is None \
                and self.python_values is None and hook_nodes.followed(module):
            return self._call_with_hook_nodes(module, args, kwargs)
        if calls.runs_opaque(module):
            if self.branch is not None:  # it would run for real, on fake tensors
                self.graph_break(
                    f"a submodule with hooks ({type(module).__name__}) cannot be called in "
                    "a torch.cond branch"
                )
            with self._in_module(module):
                return self._call_opaque_module(module, args, kwargs)
        if self.symbolic is not None or self.branch is not None \
                or self.python_values is not None:
            return trace_patches.original_module_call(module, *args, **kwargs)
        forward = module.__dict__.get("forward", type(module).forward)
        index = len(self.inline_calls)
        self.inline_calls.append((self.nodes.module_paths.get(id(module)), type(module),
                                  getattr(getattr(forward, "__func__", forward), "__code__",
                                          None)))
        outer = self._call_stack
        self._call_stack = outer + (index,)
        try:
            return trace_patches.original_module_call(module, *args, **kwargs)
        finally:
            self._call_stack = outer

    @contextlib.contextmanager
    def _in_module(self, module: nn.Module) -> Iterator[None]:
        """The node made meanwhile is `module`'s own (nnScaler's `nn_module_stack`)."""
        path = (self.nodes.module_paths.get(id(module)) if self.python_values is not None
                else None)
        if not path:
            yield
            return
        self.module_stack.append((path, type(module)))
        try:
            yield
        finally:
            self.module_stack.pop()

    def _module_scope(self) -> collections.OrderedDict:
        """The submodules whose `forward` is running, outermost first, path -> class,
        as nnScaler's tracer gives each node (`nn_module_stack`): read off the Python
        stack, so that `self.encoder.forward(x)`, which nnScaler's tracer wraps too,
        counts like `self.encoder(x)`."""
        paths = self.nodes.module_paths
        found: list[tuple[str, type]] = []
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "forward" and code.co_argcount:
                module = frame.f_locals.get(code.co_varnames[0])
                path = paths.get(id(module)) if isinstance(module, nn.Module) else None
                if path:
                    found.append((path, type(module)))
            frame = frame.f_back
        scope = collections.OrderedDict(reversed(found))
        for path, cls in self.module_stack:
            scope.setdefault(path, cls)
        return scope

    def on_module_created(self, module: nn.Module) -> None:
        self.modules.created.add(id(module))

    def on_module_setattr(self, module: nn.Module, name: str, value: Any = MISSING_VALUE) -> None:
        if id(module) in self.nodes.module_paths or id(module) in self.modules.visited:
            named = _names_literally(sys._getframe(2).f_code, name)
            if value is not MISSING_VALUE and named and writes_nothing_new(module, name, value):
                # `self.shift_size = 0` where it is 0 already: nothing to replay.  The
                # writing code names the attribute, so the state guards cover it (a
                # later value put there by someone else recaptures).
                return
            if value is not MISSING_VALUE and named and self._replayable_write(module, name, value):
                return
            self.graph_break(f"write to module state: {type(module).__name__}.{name} = ...")

    def _replayable_write(self, module: nn.Module, name: str, value: Any) -> bool:
        """Keep `module.name = value` as a write the runner replays on every hit.

        Only a plain value (`is_plain`; a number computed from training flags is
        specialised first) over a plain attribute (or none) of a module of the root's
        tree, outside torch.cond branches: the value is then a constant of this
        capture, determined by what its guards cover (the attribute's value before
        the call among them, since the writing code names it)."""
        if self.branch is not None or self.root is None:
            return False
        if id(module) not in self.nodes.module_paths:
            return False
        if isinstance(value, _TrackedNumber):
            if value.tracer is not self or getattr(value, "data_dependent", False):
                return False
            self.specialise_number(value)
            value = quiet_plain(value)
        if not is_plain(value):
            return False
        if tree_entry(module, name) is not MISSING_VALUE:
            return False   # a parameter, buffer or submodule: not a plain attribute
        if type(module).__setattr__ is not nn.Module.__setattr__:
            return False   # a class's own __setattr__ may write elsewhere
        if hasattr(type(inspect.getattr_static(type(module), name, None)), "__set__"):
            return False   # a property or slot: not an entry of the module's __dict__
        current = module.__dict__.get(name, MISSING_VALUE)
        if current is not MISSING_VALUE and not is_plain(current):
            return False
        self.modules.note_write(module, name, value)
        return True

    def on_python_side_effect(self, what: str) -> None:
        self.graph_break(what)

    def note_branch(self, module: nn.Module, value: bool) -> None:
        """Python branched on `module.training`: the graph is valid for `value` only."""
        self.modules.note_branch(module, value)

    def specialise_number(self, number: _TrackedNumber) -> None:
        """A tracked number was used as a plain Python value."""
        if number.tracer is not self:
            return
        if getattr(number, "data_dependent", False) and self.python_values is None:
            # (A value-keeping export takes this run's value, as nnScaler's concrete
            # trace does: the graph holds the path taken.)
            self.graph_break(getattr(number, "why", None) or (
                "data-dependent value: a Python number computed from tensors "
                "by an opaque op was used in Python"))
            return
        for module in number.deps:
            self.modules.note_branch(module, self.modules.flag_value(module))

    def trace_ifexpr(self, cond: Any, true_value: Any, false_value: Any) -> Any:
        """`ifexpr(cond, t, f)` under this tracer (called by nnscaler_eval.runtime)."""
        if not (self.recording and isinstance(cond, TrainingFlag) and cond.tracer is self):
            return true_value if cond else false_value
        module, value = cond.module, cond.value
        chosen = true_value if value else false_value
        try:
            if same_tensor_kind(true_value, false_value):
                node = self._ifexpr_node(module, true_value, false_value)
                with self.suspended():
                    alias = chosen.view_as(chosen)
                # A fresh alias stands for the ifexpr: the chosen tensor itself keeps
                # its own node for its other uses.
                self.nodes.map(alias, node, dynamic=self.nodes.dynamic_among(chosen))
                return alias
            if is_number(true_value) and is_number(false_value):
                node = self._ifexpr_node(module, true_value, false_value)
                deps = (module,) + deps_of(true_value) + deps_of(false_value)
                return tracked(quiet_plain(chosen), node, unique_modules(deps), self)
        except RecordingAborted:
            return chosen
        # Anything else (None, strings, tensors of different shapes): specialise.
        self.modules.note_branch(module, value)
        return chosen

    def call_with_flags(
        self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Record a C function that got a flag for a `bool` parameter (trace_patches).

        Its argument parser would reject the flag before torch function dispatch, so
        trace_patches routes such calls here: recorded with the flag as a graph input,
        run with the plain bool.
        """
        stack = torch.overrides._get_current_function_mode_stack()
        if not stack or stack[-1] is not self:
            # Another mode sits above ours; it would see a plain bool: specialise.
            return function(
                *[plain_value(a) for a in args], **{k: plain_value(v) for k, v in kwargs.items()}
            )
        with torch.overrides._pop_mode_temporarily():
            return self.__torch_function__(function, (), args, kwargs)

    # `torch.cond` under this tracer (trace_patches routes it here): cond.trace_cond,
    # called as a method, this tracer its first argument.
    trace_cond = torch_cond.trace_cond
    # An explicit `while_loop` (trace_patches routes it here): loops.trace_while_loop.
    trace_while_loop = loops.trace_while_loop

    def call_opaque(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run `fn` for real as ONE graph node (ops registered with `register_op`)."""
        if not self.recording:
            return fn(*args, **kwargs)
        if self.symbolic is not None:
            self.graph_break(f"{qualname(fn)} (register_op) runs for real")
        try:
            node_args, node_kwargs = self.graph_arg(args), self.graph_arg(kwargs)
        except RecordingAborted:
            return fn(*args, **kwargs)
        with self.suspended(), self._witnessed() as witness:
            result = fn(*torch_cond.fakeify(quiet_plain(args), self.fake_mode),
                        **torch_cond.fakeify(quiet_plain(kwargs), self.fake_mode))
        dynamic = witness.verdict(result)
        inputs_have_tensors = next(tensors_in((args, kwargs)), None) is not None
        deps = unique_modules(deps_of_args((args, kwargs)))
        try:
            if next(tensors_in(result), None) is not None or result is None:
                node = self.create_node("call_function", fn, node_args, node_kwargs)
                node.meta["nnscaler_opaque"] = True
                self.nodes.bind_result(result, node, dynamic)
                if self.python_values is not None and type(result) in (tuple, list) \
                        and any(is_number(item) for item in result):
                    # `y, _, n = op(x)`: the number is the op's output, not a constant
                    return self.python_values.sequence(result, node)
                return result
            if is_number(result):
                node = self.create_node("call_function", fn, node_args, node_kwargs)
                node.meta["nnscaler_opaque"] = True
                number = tracked(result, node, deps, self)
                number.data_dependent = inputs_have_tensors  # type: ignore[attr-defined]
                return number
            if self.python_values is not None and type(result) in (tuple, list):
                # nnScaler keeps what its op returned as the op's value (its annotation
                # says how many outputs the op has): one node, items read by getitem
                node = self.create_node("call_function", fn, node_args, node_kwargs)
                node.meta["nnscaler_opaque"] = True
                return self.python_values.sequence(result, node)
        except RecordingAborted:
            return result
        if inputs_have_tensors:
            self.graph_break(
                f"data-dependent value: {qualname(fn)}() returned a "
                f"{type(result).__name__} computed from tensors"
            )
        else:
            for module in deps:
                self.modules.note_branch(module, self.modules.flag_value(module))
        return result

    def escaped_from_opaque(self) -> str:
        """A tensor the trace never saw made reached it: if modules ran opaque for their
        forward hooks, one of those may have handed it out (hook_nodes); follow their
        hooks from the next capture on.  Words for the reason given."""
        names = hook_nodes.escaped(self.modules.opaque)
        if not names:
            return ""
        return (f" (made inside {', '.join(sorted(set(names)))}, run opaque for its "
                "forward hooks: from the next capture its forward is traced and its "
                "hooks run as graph nodes)")

    def _call_with_hook_nodes(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """`module(*args, **kwargs)` with its forward traced inline and each forward
        hook one node, run for real on every call (capture/hook_nodes.py)."""
        result = trace_patches.original_forward_call(module, *args, **kwargs)
        if not self.recording:
            return result
        try:
            module_node = self.graph_arg(module) if id(module) in self.nodes.module_paths \
                else None
            if module_node is None:
                raise RecordingAborted
            for hook_id, hook in list(module._forward_hooks.items()):
                with_kwargs = hook_id in module._forward_hooks_with_kwargs
                node_args = self.graph_arg((hook, module_node, args, kwargs, result,
                                            with_kwargs))
                # run as the node runs it (disarmed: its frames are not the trace's)
                with self.suspended(tuple(module.modules())), self._witnessed() as witness:
                    replaced = module_calls.run_forward_hook(
                        hook, module, quiet_plain(args), quiet_plain(kwargs), result,
                        with_kwargs)
                node = self.create_node("call_function", module_calls.run_forward_hook,
                                        node_args, {})
                if replaced is result:
                    # the same values, as fresh aliases standing for the node: what the
                    # hook returns on a later call replaces them there
                    replaced = pytree.tree_map_only(torch.Tensor, self._alias, result)
                self.nodes.bind_result(replaced, node, witness.verdict(replaced))
                result = replaced
        except RecordingAborted:
            pass
        return result

    def _alias(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.suspended():
            return tensor.view_as(tensor)

    def _call_opaque_module(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if self.symbolic is not None and self.recording:
            # It would run for real on fake tensors (its hooks too).
            self.graph_break(f"a module with hooks ({type(module).__name__}) runs for real")
        call = trace_patches.original_module_call
        path = self.nodes.module_paths.get(id(module))
        if path is None and self.root is not None:
            self.graph_break(
                f"a submodule with hooks ({type(module).__name__}) that is not "
                "reachable from self's module tree"
            )
            return call(module, *args, **kwargs)
        try:
            node_args, node_kwargs = self.graph_arg(args), self.graph_arg(kwargs)
        except RecordingAborted:
            return call(module, *args, **kwargs)
        self.modules.opaque[id(module)] = module
        # A layer with an eval fast path runs with no torch function mode active,
        # as eager runs it: with one, torch takes its other path.
        unseen = (torch._C.DisableTorchFunction() if calls.takes_eval_fast_path(module)
                  else contextlib.nullcontext())
        with self.suspended(tuple(module.modules())), unseen, eager_answers(), \
                self._witnessed() as witness:
            result = call(module, *quiet_plain(args), **quiet_plain(kwargs))
        if not self.recording:
            return result
        outside = [
            v
            for v in pytree.tree_leaves(result)
            if not isinstance(v, (torch.Tensor, *LITERAL_TYPES))
        ]
        if outside:
            self.graph_break(
                f"a module with hooks ({type(module).__name__}) returned a "
                f"{type(outside[0]).__name__}, which the graph cannot carry"
            )
            return result
        target = self.nodes.module_target(module)
        try:
            node = self.create_node("call_module", target, node_args, node_kwargs)
        except RecordingAborted:
            return result
        # opaque for its hooks alone: a runner may run the hooks disarmed
        node.meta["nnscaler_hooked"] = calls.opaque_for_hooks_only(module)
        self.nodes.bind_result(result, node, witness.verdict(result))
        return result

    @contextlib.contextmanager
    def _witnessed(self) -> Iterator["_OpaqueWitness"]:
        """Watch code run for real as one node (an opaque module, a register_op op):
        did anything inside make a shape from tensor values?"""
        witness = _OpaqueWitness(self.data_dependence)
        try:
            yield witness
        finally:
            witness.close()

    # -- TorchFunctionMode ---------------------------------------------------------

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Optional[dict[str, Any]] = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if signals.pending():
            signals.deliver()
        if inspect.isfunction(func) and not is_library_file(func.__code__.co_filename):
            # The user replaced a torch function (`F.dropout = wrapper`) and torch's own
            # dispatch named the replacement (the original looks itself up by global
            # name): which op it stands for is unknown, and its body runs untraced here.
            # An export for nnScaler (no guards, called where the same patch may hold)
            # records the API by its name instead, as nnScaler's tracer does.
            replaced = calls.replaced_api(func) if self.python_values is not None else None
            result = calls.undispatched_result(func, quiet_plain(args), quiet_plain(kwargs))
            if replaced is None or not self.recording:
                self.graph_break(f"{qualname(func)} replaced a torch function and reached "
                                 "torch function dispatch")
                return result
            kind, target = replaced
            try:
                return self._record_call(target if kind == "function" else func, kind,
                                         target, args, kwargs, result, None)
            except RecordingAborted:
                return result
        if not self.recording:
            return func(*quiet_plain(args), **quiet_plain(kwargs))
        if self.symbolic is not None and func in symbolic_shapes.SYMBOLIC_MATH:
            # torch.sym_float(2), sym_max(L, 4): arithmetic on symbols and numbers, no
            # tensor; its result is written into the graph where it is used.
            return func(*args, **kwargs)
        if func in calls.STATE_CHANGES:  # e.g. set_grad_enabled(self.training): a branch
            return func(*[plain_value(a) for a in args], **kwargs)
        kind, target = calls.classify(func)
        if kind == "method" and target in calls.DATA_ACCESS:
            if self.python_values is not None and target in DATA_VALUES:
                result = func(*quiet_plain(args), **quiet_plain(kwargs))
                try:
                    return self.python_values.data_value(args, result)
                except RecordingAborted:
                    return result
            self.graph_break(calls.DATA_ACCESS[target])
            return func(*quiet_plain(args), **quiet_plain(kwargs))
        if (target in calls.SHAPE_QUERIES or target is torch.numel) and self.nodes.dynamic_shape:
            why = self.nodes.dynamic_among(args)
            if why is not None:
                count = self._data_dependent_count(func, kind, target, args, kwargs, why)
                if count is not None:
                    return count
                self.graph_break(f"data-dependent shape: {qualname(func)} of a tensor whose "
                                 f"shape depends on tensor values ({why})")
                return func(*quiet_plain(args), **quiet_plain(kwargs))
        dynamic: Optional[str] = None
        if self.branch is not None:
            result = torch_cond.call_in_branch(self, func, args, kwargs)
        elif self.symbolic is not None:
            # A dynamic capture: real tensors (parameters, buffers, constants) as
            # fakes, so that no op touches real data (FakeTensorMode would run an
            # in-place op on a real buffer for real: `num_batches_tracked.add_(1)`).
            fake_mode = self.symbolic.fake_mode
            call_args = torch_cond.fakeify(quiet_plain(args), fake_mode)
            if func in symbolic_shapes.DATA_CONSTRUCTORS:
                # A symbolic value as tensor *data* (`torch.tensor([t])`): the node
                # takes the expression; a fake has no data, so the run takes any value
                # (the hint) instead of specialising the symbol.
                call_args = symbolic_shapes.with_hints(call_args)
            call_kwargs = torch_cond.fakeify(quiet_plain(kwargs), fake_mode)
            try:
                result = self._unrecorded(func, *call_args, **call_kwargs)
            except (symbolic_shapes.Unsupported, GraphBreakError, KeyboardInterrupt,
                    SystemExit):
                raise
            except Exception as exc:
                if unwinding.interrupt_in(exc) is not None:   # not a refusal: Ctrl-C
                    raise
                # Say which op refused which symbolic argument (the static capture
                # that follows raises eager's error, if it is one).
                raise symbolic_shapes.Unsupported(
                    symbolic_shapes.refusal(qualname(func), call_args, call_kwargs, exc)
                ) from exc
        else:
            plain_args, plain_kwargs = quiet_plain(args), quiet_plain(kwargs)
            watch = self.data_dependence
            record = watch.begin((plain_args, plain_kwargs))
            try:
                result = self._unrecorded(func, *plain_args, **plain_kwargs)
            finally:
                watch.close(record)
            dynamic = self._unrecorded(watch.verdict, record, func, plain_args, plain_kwargs,
                                       result)
        if signals.pending():
            signals.deliver()
        try:
            return self._record_call(func, kind, target, args, kwargs, result, dynamic)
        except RecordingAborted:
            return result

    def _data_dependent_count(self, func: Any, kind: str, target: Any, args: tuple[Any, ...],
                              kwargs: dict[str, Any], why: str) -> Optional[Any]:
        """`x.numel()` or `x.size(d)` of a tensor whose shape came from data, as a
        number the graph computes on every call (a node), in a static capture: Python
        may compare it (the comparison is a node too, tracked_values) and branch on
        that (an `if` converted to torch.cond, capture/branches.py); any other use of
        its value is a graph break, as before.  None: not such a query."""
        if self.symbolic is not None or self.branch is not None or self.python_values is not None:
            return None
        counting = (func is torch.numel or (kind == "method" and target in ("numel", "nelement"))
                    or (kind == "method" and target == "size" and len(args) == 2
                        and not kwargs and isinstance(args[1], int)))
        if not counting:
            return None
        value = func(*quiet_plain(args), **quiet_plain(kwargs))
        if not isinstance(value, int):
            return None
        try:
            node_args = self.graph_arg(args)
            if kind == "method":
                node = self.create_node("call_method", target, node_args, {})
            else:
                node = self.create_node("call_function", func, node_args, {})
        except RecordingAborted:
            return None
        number = tracked(value, node, (), self)
        number.data_dependent = True  # type: ignore[attr-defined]
        number.why = (f"data-dependent shape: {qualname(func)} of a tensor whose shape "  # type: ignore[attr-defined]
                      f"depends on tensor values ({why}) was used in Python")
        return number

    def number_operator(self, function: Callable[..., Any], operands: tuple[Any, ...]) -> Any:
        """A Python operator on a data-dependent number (`n > 0` of a count above):
        a node, and a data-dependent number of its result (tracked_values)."""
        plain = function(*[quiet_plain(o) for o in operands])
        if not isinstance(plain, (int, float)) or not self.recording:
            return plain
        try:
            node = self.create_node("call_function", function, self.graph_arg(operands), {})
        except RecordingAborted:
            return plain
        number = tracked(plain, node, (), self)
        number.data_dependent = True  # type: ignore[attr-defined]
        first = next(o for o in operands if isinstance(o, _TrackedNumber))
        number.why = getattr(first, "why", None)  # type: ignore[attr-defined]
        return number

    def _record_call(
        self,
        func: Any,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: Any,
        dynamic: Optional[str],
    ) -> Any:
        """Write the call as a node; `dynamic`: why its results' shapes depend on tensor
        values, as the static run's witness found (None: ask the fakes, or the inputs).
        Returns what the forward gets: `result`, or a shape recorded as a graph value
        (python_values)."""
        if result is NotImplemented:
            return result
        if next(tensors_in(result), None) is None:
            verdict, reason = calls.tensorless_result(func, kind, target, result)
            if verdict == "metadata":
                self.read_metadata = True
                for tensor in tensors_in(args):
                    if id(tensor) not in self.nodes.tensor_nodes:
                        self.metadata_tensors[id(tensor)] = tensor
                if self.python_values is not None:
                    recorded = self.python_values.query(func, kind, target, args, kwargs,
                                                        result)
                    if recorded is not None:
                        return recorded
                return result
            if verdict == "break":
                self.graph_break(reason)
                return result
        node_args, node_kwargs = self.graph_arg(args), self.graph_arg(kwargs)
        if kind == "method":
            node = self.create_node("call_method", target, node_args, node_kwargs)
        elif kind == "operator":
            function, reflected = OPERATORS[target]
            if reflected:
                node_args = (node_args[1], node_args[0], *node_args[2:])
            node = self.create_node("call_function", function, node_args, node_kwargs)
        elif kind == "getattr":
            node = self.create_node("call_function", getattr, (node_args[0], target), {})
        elif kind == "setattr":
            node = self.create_node(
                "call_function", setattr, (node_args[0], target, node_args[1]), {}
            )
        else:
            node = self.create_node("call_function", func, node_args, node_kwargs)
        if kind in ("method", "function"):
            node.meta[direct_calls.PLAIN_META] = direct_calls.args_are_plain(
                args, kwargs, (FakeTensor,) if self.symbolic is not None else ())
        if dynamic is None and (self.symbolic is not None or self.branch is not None) \
                and has_unbacked_size(result):
            dynamic = f"{qualname(func)} makes an output whose shape depends on tensor data"
        if dynamic is None:
            dynamic = self.nodes.dynamic_among((args, kwargs))
            if dynamic is not None and isinstance(result, (tuple, list)) \
                    and not hasattr(result, "_fields") and next(tensors_in(result), None) is not None:
                # How many results there are may follow from the data-dependent size
                # (`split`, `chunk`, `unbind`): the graph would hold a fixed count.
                self.graph_break(f"data-dependent shape: {qualname(func)} of a tensor whose "
                                 f"shape depends on tensor values ({dynamic}) returned "
                                 f"{len(result)} results")
                return result
        self.nodes.bind_result(result, node, dynamic)
        return result

    # -- building nodes ------------------------------------------------------------

    def create_node(self, op: str, target: Any, args: Any, kwargs: Any) -> fx.Node:
        """A node of the graph being recorded, after syncing grad mode and autocast."""
        self.sync_global_state()
        node = self.graph.create_node(op, target, tuple(args), dict(kwargs))
        record_source(node)
        if self._call_stack:
            node.meta["nnscaler_calls"] = self._call_stack
        if self.python_values is not None:
            # as nnScaler's tracer sets it: each submodule's path and class, outermost
            # first (its autodist groups operators by it)
            node.meta["nn_module_stack"] = self._module_scope()
            node.meta["nnscaler_constant_folding"] = self.python_values.node_context()
        return node

    def _ifexpr_node(self, module: nn.Module, true_value: Any, false_value: Any) -> fx.Node:
        flag = self._local(self.modules.flag_node(module, self.nodes),
                           self.modules.flag_value(module))
        return self.create_node(
            "call_function",
            ifexpr,
            (flag, self.graph_arg(true_value), self.graph_arg(false_value)),
            {},
        )

    def _node_for_tensor(self, tensor: torch.Tensor) -> fx.Node:
        node = self.nodes.known(tensor)
        if node is not None:
            return node
        if isinstance(tensor, FakeTensor):
            # Made inside a cond branch but not by a recorded op (or leaked out of one),
            # or by a run on fakes outside any branch.
            self.graph_break(
                "a tensor of a torch.cond branch was made outside torch function dispatch"
                if self.branch is not None else
                "a fake tensor made outside torch function dispatch reached the graph"
            )
            raise RecordingAborted
        if torch._C._functorch.is_functorch_wrapped_tensor(tensor):
            # A tensor of a torch.func transform (vmap, grad) that the transform
            # made below the dispatch the trace sees: valid only inside it.
            self.graph_break("a tensor of a torch.func transform (vmap, grad) "
                             "reached the graph")
            raise RecordingAborted
        with torch._C.DisableTorchFunction():
            computed = tensor.grad_fn is not None
        held_before = self.modules.held_before(tensor)
        if not held_before:
            self.unproven_constants[id(tensor)] = tensor
        if computed and not held_before:
            # It was computed in this run, but not through torch function dispatch
            # (e.g. under torch._C.DisableTorchFunction): baking it in would be wrong.
            # One that module state held before the run (an earlier eager call cached
            # it) is state: a constant of the graph, held by reference, and its
            # module's dict (and the container it sits in) is guarded by identity.
            escaped = self.escaped_from_opaque()
            self.graph_break(
                "a tensor computed outside torch function dispatch "
                f"({type(tensor.grad_fn).__name__}) reached the graph" + escaped
            )
            if escaped and self.fallback is not None:
                self.fallback.retry = True
            raise RecordingAborted
        return self.nodes.constant_tensor(tensor)

    def _local(self, node: fx.Node, value: Any) -> fx.Node:
        """`node` as a value of the graph being recorded: inside a cond branch, a value
        of an enclosing graph becomes an input of the branch (lifted, level by level)."""
        if node.graph is self.graph:
            return node
        lifted = torch_cond.lift(self.branch, node, value, self.root_graph)
        if lifted is None:
            reason = "a value computed inside a torch.cond branch is used outside it"
            self.graph_break(reason)
            # It is a fake tensor: running on with it would compute garbage.
            raise RuntimeError(f"{reason} (torch.cond branches must not leak values)")
        return lifted

    def graph_arg(self, value: Any) -> Any:
        """`value` as an fx argument: tensors, flags and tracked numbers become nodes."""
        if isinstance(value, torch.Tensor):
            return self._local(self._node_for_tensor(value), value)
        if isinstance(value, TrainingFlag):
            if value.tracer is not self:
                return value.value
            return self._local(self.modules.flag_node(value.module, self.nodes), value.value)
        if isinstance(value, _TrackedNumber):
            return self._local(value.node, value.plain) if value.tracer is self else value.plain
        if isinstance(value, fx.Node):   # already a node of this graph (python_values)
            return value
        if isinstance(value, TRACKED_SEQUENCES) and value.tracking.tracer is self:
            return self._local(value.node, value._base(value))
        if isinstance(value, (tuple, list)):
            items = [self.graph_arg(v) for v in value]
            if isinstance(value, list):
                return items
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, dict):
            return {k: self.graph_arg(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(
                self.graph_arg(value.start),
                self.graph_arg(value.stop),
                self.graph_arg(value.step),
            )
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            if self.symbolic is None:
                self.graph_break("a symbolic size from outside this capture reached the graph")
                raise RecordingAborted
            try:
                return self.symbolic.graph_value(self, value)
            except symbolic_shapes.Unsupported as exc:
                self.graph_break(f"dynamic shapes: {exc}")
                raise RecordingAborted
        if isinstance(value, LITERAL_TYPES):
            return value
        if isinstance(value, nn.Module):
            if id(value) not in self.nodes.module_paths and self.root is not None:
                self.graph_break(
                    f"a module outside self's module tree ({type(value).__name__}) "
                    "was passed to an op"
                )
                raise RecordingAborted
            return self._local(self.nodes.module_node(value), value)
        return self.nodes.constant(value, f"const_{type(value).__name__}_")

    def symbol_node(self, symbolic: Any, symbol: Any) -> fx.Node:
        """The node of a symbol of a dynamic capture, as a value of the graph being
        recorded: the int argument's placeholder, or `x.size(d)` of the argument it
        is a size of, made once at the top of the root graph."""
        node = symbolic.symbol_nodes.get(symbol)
        if node is None:
            index, dim = symbolic.sources[symbol]
            tensor = symbolic.field_values[index]
            placeholder = self.nodes.known(tensor)
            if placeholder is None:
                raise symbolic_shapes.Unsupported(f"{symbol} has no input node")
            with self.root_graph.inserting_after(placeholder):
                node = self.root_graph.create_node("call_method", "size", (placeholder, dim), {})
            symbolic.symbol_nodes[symbol] = node
        return self._local(node, symbolic.hint(symbol))

    def sync_global_state(self) -> None:
        """Make the graph's grad mode and autocast state match the run's, before a node
        (see global_state)."""
        if self.global_state.inference_mode_changed():
            self.graph_break("torch.inference_mode() changed inside forward")
            raise RecordingAborted
        self.global_state.sync(self.graph)

    # -- the end -----------------------------------------------------------------------

    def _record_output(self, result: Any) -> Optional[OutputLayout]:
        def refuse(reason: str) -> None:
            self.graph_break(reason, location=self._forward_location())

        try:
            laid_out = output.output_layout(result, self.slots, self.graph_arg, refuse,
                                            self.rebuild_objects, self.passed)
            if laid_out is None:
                return None
            self.sync_global_state()  # e.g. grad mode left changed by the forward
        except RecordingAborted:
            return None
        layout, graph_outputs = laid_out
        self.graph.output(tuple(graph_outputs))
        return layout

    def _make_capture(self, result: Any, layout: Optional[OutputLayout]) -> Capture:
        capture = output.make_capture(
            fn=self.fn,
            result=result,
            layout=layout,
            graph=self.graph,
            nodes=self.nodes,
            modules=self.modules,
            root=self.root,
            slot_names=self.slot_names,
            fallback=self.fallback,
            entry_grad_mode=self.global_state.entry_grad_mode,
            read_metadata=self.read_metadata,
            metadata_tensors=list(self.metadata_tensors.values()),
            unproven_constants=list(self.unproven_constants.values()),
            branch_notes=list(self.branches.notes),
        )
        capture.inline_calls = self.inline_calls
        self.metadata_tensors = {}
        # The trace's bookkeeping holds every intermediate tensor: drop it now.
        self.nodes.forget()
        return capture
