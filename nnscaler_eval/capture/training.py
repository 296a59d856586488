"""Training flags and module state: what the trace knows of the modules it runs.

`module.training` is a `TrainingFlag` for the length of the trace (see
tracked_values), on the tracing thread only: trace_patches' descriptor on `nn.Module`
asks `read_training`, and module `__dict__`s keep their real bools. Used as a value a
flag becomes one placeholder per module, after the tensor placeholders
(`Capture.training_inputs`); used to branch it specialises the graph
(`Capture.branched_training`, which the caller guards). Numbers computed from flags
are tracked numbers (`tracked`), with the modules they depend on.

Each module the trace goes through is snapshotted (its attributes, and one level into
container attributes), so that state writes the `__setattr__` patch cannot see are
caught at the end, and so that convert_frame can tell whether another thread changed
the modules while this one captured.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from nnscaler_eval.tracing import trace_patches
from nnscaler_eval.shared_objects import global_hook_items
from nnscaler_eval.capture.nodes import NodeMap
from nnscaler_eval.guarding.state_guards import same_value
from nnscaler_eval.capture.results import MISSING_VALUE
from nnscaler_eval.tracing.tracked_values import TrackedFloat, TrackedInt, TrainingFlag, _TrackedNumber

_MISSING = object()


class TrackedModules:
    """The modules of one trace: their flags, which were branched on, which were
    visited (with their state as first seen), which ran opaque."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner  # the tracer: what each flag names as its tracer
        # Training flags: id(module) -> (module, original value, flag). `live` holds
        # those `module.training` answers with on this thread now (trace_patches'
        # descriptor asks read_training); module `__dict__`s keep their real bools.
        self.swapped: dict[int, tuple[nn.Module, Any, TrainingFlag]] = {}
        self.live: dict[int, tuple[nn.Module, Any, TrainingFlag]] = {}
        self.flag_nodes: dict[int, fx.Node] = {}
        self.training_inputs: list[nn.Module] = []
        self.branched: dict[int, tuple[nn.Module, bool]] = {}
        self.visited: dict[int, nn.Module] = {}
        self.snapshots: dict[int, dict[str, tuple[Any, Any]]] = {}
        self.opaque: dict[int, nn.Module] = {}
        # Modules the forward built during the trace (`nn.Softmax(dim=-1)(x)`): ids
        # noted by the `nn.Module.__init__` patch; `fresh` holds those the trace went
        # through that own no tensors (see `visit`).
        self.created: set[int] = set()
        self.fresh: dict[int, nn.Module] = {}
        # Plain values the forward wrote to module attributes, replayed on every hit
        # (`note_write`): (id(module), name) -> [module, name, value before, value now].
        self.writes: dict[tuple[int, str], list[Any]] = {}

    def forget(self) -> None:
        """Let go of every module once the capture is made (tables rebound, not
        cleared: the Capture holds some of these lists)."""
        self.swapped, self.live, self.flag_nodes = {}, {}, {}
        self.training_inputs, self.branched, self.visited = [], {}, {}
        self.snapshots, self.opaque = {}, {}
        self.created, self.fresh = set(), {}
        self.writes = {}

    # -- flags ---------------------------------------------------------------------

    def swap_training(self, module: nn.Module) -> None:
        """From now on `module.training` reads as a TrainingFlag on this thread only
        (trace_patches' descriptor asks read_training); its `__dict__` is untouched."""
        if id(module) in self.swapped:
            return
        current = module.__dict__.get("training", _MISSING)
        if current is _MISSING:
            return
        value = current.value if isinstance(current, TrainingFlag) else bool(current)
        flag = TrainingFlag(value, module, self._owner)
        entry = (module, current, flag)
        self.swapped[id(module)] = entry
        if trace_patches.training_is_ours(module):
            self.live[id(module)] = entry
        else:
            # A class of it defines `training` itself, shadowing the descriptor: reads
            # cannot be told apart from branches, so the graph is valid for this value.
            self.note_branch(module, value)

    def read_training(self, module: nn.Module, value: Any) -> Any:
        """`module.training` on this thread (trace_patches' descriptor): its flag while
        this trace records it, else `value`, the real `__dict__` entry."""
        entry = self.live.get(id(module))
        if entry is None or entry[0] is not module or entry[1] is not value:
            return value  # not ours, hidden (suspended), or written since the swap
        return entry[2]

    def restore_training(self) -> None:
        # One C-level operation: an interrupt cannot leave it half done.
        self.live.clear()

    def hide(self, modules: tuple[nn.Module, ...]) -> dict[int, Any]:
        """Give `modules` their real `training` values back for a while; returns what
        `unhide` puts back."""
        hidden = {}
        for module in modules:
            entry = self.live.pop(id(module), None)
            if entry is not None:
                hidden[id(module)] = entry
        return hidden

    def unhide(self, hidden: dict[int, Any]) -> None:
        self.live.update(hidden)

    def note_branch(self, module: nn.Module, value: bool) -> None:
        """Python branched on `module.training`: the graph is valid for `value` only."""
        self.branched.setdefault(id(module), (module, value))

    def flag_value(self, module: nn.Module) -> bool:
        entry = self.swapped.get(id(module))
        if entry is not None:
            return entry[2].value
        training = module.__dict__.get("training")
        return training.value if isinstance(training, TrainingFlag) else bool(training)

    def flag_node(self, module: nn.Module, nodes: NodeMap) -> fx.Node:
        """The training placeholder of `module` (created on first use as a value)."""
        node = self.flag_nodes.get(id(module))
        if node is None:
            path = nodes.module_paths.get(id(module))
            if path is None:
                name = f"{type(module).__name__}_training"
            else:
                name = f"{path.replace('.', '_')}_training" if path else "training"
            node = nodes.placeholder(name, self.flag_value(module))
            node.meta["nnscaler_input"] = None
            self.flag_nodes[id(module)] = node
            self.training_inputs.append(module)
        return node

    # -- module state ----------------------------------------------------------------

    def visit(self, module: nn.Module, swap: bool) -> None:
        """The trace went through `module`: snapshot its state; `swap`: give it a flag
        too (not once the capture fell back)."""
        if id(module) in self.visited or id(module) in self.fresh:
            return
        if id(module) in self.created and not _owns_tensors(module):
            # Built by this very call, and so by every call: its state is what the
            # code that built it made from values the capture guards, it is a new
            # object next time, and its `training` is what construction set (read
            # as a plain bool).  Guarding its identity or its dict would drop the
            # entry as soon as it is freed.  One that owns parameters or buffers is
            # not: those tensors are new (random) each call, and the graph reads them.
            self.fresh[id(module)] = module
            return
        if swap:
            self.swap_training(module)
        self.visited[id(module)] = module
        self.snapshots[id(module)] = _module_state(module)

    def note_write(self, module: nn.Module, name: str, value: Any) -> None:
        """`module.name = value` (a plain value, `is_plain`) is about to happen: keep
        the value the attribute held before the first such write and the latest one."""
        key = (id(module), name)
        write = self.writes.get(key)
        if write is None:
            self.writes[key] = [module, name, module.__dict__.get(name, MISSING_VALUE), value]
        else:
            write[3] = value

    def _expected_state(self, key: int) -> dict[str, tuple[Any, Any]]:
        """A visited module's snapshot with the writes `note_write` kept applied."""
        state = self.snapshots[key]
        written = [w for (k, _), w in self.writes.items() if k == key]
        if not written:
            return state
        state = dict(state)
        for _, name, _, value in written:
            state[name] = (value, None)
        return state

    def held_before(self, tensor: torch.Tensor) -> bool:
        """`tensor` was in a visited module's state when the trace first went through
        that module (an attribute, or an item of a dict, list or set attribute): it
        was made before this run, by an earlier eager call for one (a cache of
        attention biases), whatever autograd history it carries."""
        for state in self.snapshots.values():
            for value, contents in state.values():
                if value is tensor:
                    return True
                if contents is None:
                    continue
                for item in contents:
                    if item is tensor or (type(item) is tuple and len(item) == 2
                                          and item[1] is tensor):
                        return True
        return False

    def changed(self) -> Optional[tuple[nn.Module, str]]:
        """A visited module whose state changed since its snapshot, and the attribute
        (writes the `__setattr__` patch cannot see: `object.__setattr__`, `__dict__`
        updates, mutated attribute containers); None if none did."""
        inside_opaque: set[int] = set()
        for module in self.opaque.values():
            inside_opaque.update(id(m) for m in module.modules())
        for key, module in self.visited.items():
            if key in inside_opaque:
                continue  # an opaque module runs for real on every call
            changed = _same_state(self._expected_state(key), _module_state(module))
            if changed is not None:
                return module, changed
        return None

    def unchanged_check(self, global_hooks: Any) -> Callable[[], bool]:
        """A check that the modules the trace went through, and the global hooks, are
        still as the trace saw them (hooks, the module tree, attributes).

        Another thread may change them while this one captures; the C entry snapshots
        its guarded dicts' versions only when convert_frame builds it, after the trace.
        convert_frame calls this once the entry exists: a change in between makes the
        entry wrong yet valid by its versions, so it is dropped (the call's result
        stands; the next call captures again).
        """
        visited = dict(self.visited)
        snapshots = {key: self._expected_state(key) for key in visited}
        inside_opaque = {id(m) for o in self.opaque.values() for m in o.modules()}

        def unchanged() -> bool:
            if global_hook_state() != global_hooks:
                return False
            return all(
                _same_state(snapshots[key], _module_state(module)) is None
                for key, module in visited.items()
                if key not in inside_opaque
            )

        return unchanged


def _owns_tensors(module: nn.Module) -> bool:
    """Does `module` hold a parameter or buffer?  A slot registered as None (the
    `weight` buffer of every loss module built without one) holds nothing."""
    return any(v is not None for v in module._parameters.values()) or \
        any(v is not None for v in module._buffers.values())


def global_hook_state() -> tuple[Any, ...]:
    """The global module hooks, by identity (a change means another graph)."""
    return tuple(tuple(d.items()) for _, d in global_hook_items())


def _module_state(module: nn.Module) -> dict[str, tuple[Any, Any]]:
    """What `self.x = ...` and friends can change: each attribute's object, and for a
    container attribute (the `_parameters` / `_buffers` / `_modules` / hook dicts, user
    lists and dicts) the objects inside it, one level deep."""
    state: dict[str, tuple[Any, Any]] = {}
    for name, value in module.__dict__.items():
        if name == "training":
            continue
        if isinstance(value, dict):
            contents: Any = tuple((k, v) for k, v in value.items())
        elif isinstance(value, (list, set)):
            contents = tuple(value)
        else:
            contents = None
        state[name] = (value, contents)
    return state


def tree_state(root: nn.Module) -> list[tuple[nn.Module, dict[str, tuple[Any, Any]]]]:
    """`_module_state` of every module of `root`'s tree (restore_tree_state)."""
    return [(module, _module_state(module)) for module in root.modules()]


# nn.Module's hook tables: other threads register and remove hooks on a shared module
# while a capture runs, and a forward does not keep state there.  Putting one back as
# it was would bring back a hook removed meanwhile, or drop one added.
_HOOK_TABLES = frozenset(name for name in nn.Module().__dict__ if "hook" in name)


def restore_tree_state(saved: list[tuple[nn.Module, dict[str, tuple[Any, Any]]]]) -> None:
    """Put each module's attributes, and the contents of its container attributes one
    level deep, back as `tree_state` saw them (a symbolic capture that failed after
    the forward wrote module state with fake values: a cache keyed by length).  The
    hook tables stay as they are now (_HOOK_TABLES)."""
    for module, state in saved:
        current = module.__dict__
        for name in [n for n in current if n not in state and n != "training"]:
            del current[name]
        for name, (value, contents) in state.items():
            if name in _HOOK_TABLES and current.get(name) is value:
                continue
            current[name] = value
            if isinstance(value, dict) and contents is not None:
                if tuple(value.items()) != contents:
                    value.clear()
                    value.update(contents)
            elif isinstance(value, list) and contents is not None:
                if tuple(value) != contents:
                    value[:] = contents
            elif isinstance(value, set) and contents is not None:
                value.clear()
                value.update(contents)


_PLAIN = (int, float, complex, bool, str, bytes, type(None))


def same_plain(a: Any, b: Any) -> bool:
    """`a` and `b` are the same plain value (ints, floats, bools, strings, None and
    tuples of them, compared by type and value; NaN is never the same), so writing
    one over the other changes nothing a later call could read."""
    return same_value(a, b, _PLAIN)


def is_plain(value: Any) -> bool:
    """An int, float, complex, bool, str, bytes or None, or a tuple of them: a value a
    runner can write again as a literal."""
    if type(value) is tuple:
        return all(is_plain(item) for item in value)
    return type(value) in _PLAIN


def tree_entry(module: nn.Module, name: str) -> Any:
    """The parameter, buffer or submodule `name` of `module`, or MISSING_VALUE when
    `name` is none of them."""
    for where in ("_parameters", "_buffers", "_modules"):
        table = module.__dict__.get(where)
        if isinstance(table, dict) and name in table:
            return table[name]
    return MISSING_VALUE


def writes_nothing_new(module: nn.Module, name: str, value: Any) -> bool:
    """`module.name = value` (through nn.Module.__setattr__) leaves the module as it
    is: the attribute, parameter, buffer or submodule of that name already holds
    `value` (itself, or the same plain value)."""
    entry = tree_entry(module, name)
    if entry is not MISSING_VALUE:
        return entry is value
    current = module.__dict__.get(name, MISSING_VALUE)
    return current is not MISSING_VALUE and same_plain(current, value)


def _same_state(
    before: dict[str, tuple[Any, Any]], after: dict[str, tuple[Any, Any]]
) -> Optional[str]:
    """The first attribute that differs between two `_module_state`s, or None."""
    for name in before.keys() | after.keys():
        if name not in before or name not in after:
            return name
        (old, old_contents), (new, new_contents) = before[name], after[name]
        if old is not new and not same_plain(old, new):
            return name
        if old_contents is None:
            continue
        if len(old_contents) != len(new_contents):
            return name
        for a, b in zip(old_contents, new_contents):
            if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == 2 == len(b):
                if a[0] != b[0] or a[1] is not b[1]:
                    return name
            elif a is not b:
                return name
    return None


# ---------------------------------------------------------------------------
# Values that depend on flags (ifexpr, numbers computed from flags)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, torch.Tensor)


def same_tensor_kind(a: Any, b: Any) -> bool:
    """Both tensors, with the same metadata: then one graph serves both branches."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    with torch._C.DisableTorchFunction():
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and a.requires_grad == b.requires_grad
        )


def deps_of(value: Any) -> tuple[nn.Module, ...]:
    if isinstance(value, TrainingFlag):
        return (value.module,)
    if isinstance(value, _TrackedNumber):
        return tuple(value.deps)
    return ()


def deps_of_args(value: Any) -> tuple[nn.Module, ...]:
    """Modules whose training flag an opaque op could read through its arguments."""
    if isinstance(value, nn.Module):
        return (value,)
    if isinstance(value, (TrainingFlag, _TrackedNumber)):
        return deps_of(value)
    if isinstance(value, (tuple, list)):
        return tuple(m for v in value for m in deps_of_args(v))
    if isinstance(value, dict):
        return tuple(m for v in value.values() for m in deps_of_args(v))
    return ()


def unique_modules(modules: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
    seen: dict[int, nn.Module] = {}
    for module in modules:
        seen.setdefault(id(module), module)
    return tuple(seen.values())


def tracked(value: Any, node: fx.Node, deps: tuple[nn.Module, ...], tracer: Any) -> Any:
    if isinstance(value, float):
        return TrackedFloat(value, node, deps, tracer)
    return TrackedInt(value, node, deps, tracer)
