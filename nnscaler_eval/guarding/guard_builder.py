"""From one capture to its guards (docs/design.md, "Guards": kinds 2 and 3; kind 1,
the per-call key, is computed in C from the call's arguments).

Structural guards: for every module the trace went through, its `_modules`,
`_parameters` and `_buffers` (the module tree) and, unless `skip_nnmodule_hook_guards`,
its hook dicts, plus the global hook dicts, each compared by value (below).  Training
flags the trace branched on are guarded by value.  Plain values the capture
could have read (attributes, globals, cells, argument objects' state, tensor metadata,
global torch state) are value guards, built by `state_guards`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from nnscaler_eval.guarding import state_guards
from nnscaler_eval.shared_objects import global_hook_items

# The module tree and the hook dicts are guarded by value: the same objects under
# exactly the same keys, re-validated when the dict's version moved. By version alone
# they recaptured when nothing had changed in the end: FSDP2 swaps sharded and
# unsharded parameters in and out of `_parameters` around every step (the graph reads
# them live), and transformers registers hooks for the length of a call and removes
# them (`output_capturing`), leaving the hook dicts as they were.
TREE_DICTS = ("_modules", "_parameters", "_buffers")
# torch writes _forward_hooks / _forward_pre_hooks on every register and remove
# (the *_with_kwargs / *_always_called dicts only ever change together with them:
# register_forward_hook and RemovableHandle(extra_dict=...)), so those two stand for
# all five forward dicts. Fewer dicts: the state check is memory-bound on 3.11.
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


@dataclass
class StateGuards:
    flags: list[tuple[torch.nn.Module, bool]]
    names: list[str]          # flag guards first, then value guards
    values: list[tuple[Any, ...]] = field(default_factory=list)   # value-guard specs
    not_guarded: list[str] = field(default_factory=list)          # beyond the walk's bounds


def module_names(root: Optional[torch.nn.Module]) -> dict[int, str]:
    """id(module) -> a readable path from `root` ("self", "self.layers.0")."""
    if root is None:
        return {}
    names: dict[int, str] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        names.setdefault(id(module), "self" + ("." + name if name else ""))
    return names


def module_label(module: torch.nn.Module, names: dict[int, str]) -> str:
    return names.get(id(module), f"<{type(module).__name__} at {id(module):#x}>")


def build_state_guards(capture: Any, root: Optional[torch.nn.Module], skip_hook_guards: bool,
                       extra_flags: Sequence[tuple[torch.nn.Module, bool]] = (),
                       reads: Optional[ReadContext] = None) -> StateGuards:
    """`extra_flags`: training flags a backend folded into its graph (guarded by value,
    like the flags the trace branched on).  `reads`: what the capture ran and read
    (value guards); None builds the structural guards only."""
    names = module_names(root)
    guards = StateGuards([], [])
    seen: set[int] = set()

    tree_specs: list[tuple[Any, ...]] = []
    tree_names: list[str] = []

    def add_dict(d: Any, label: str) -> None:
        if isinstance(d, dict) and id(d) not in seen:
            seen.add(id(d))
            tree_specs.append((state_guards.VG_DICT, d, tuple(d), tuple(d.values()),
                               state_guards.MISSING, None, True))
            tree_names.append(f"{label}: the same {len(d)} entries")

    modules = list(capture.visited_modules)
    if root is not None and all(m is not root for m in modules):
        modules.insert(0, root)
    for module in modules:
        label = module_label(module, names)
        attrs = module.__dict__
        for attr in TREE_DICTS:
            add_dict(attrs.get(attr), f"{label}.{attr} ({type(module).__name__})")
        if not skip_hook_guards:
            for attr in HOOK_DICTS:
                add_dict(attrs.get(attr), f"{label}.{attr} ({type(module).__name__})")
    if not skip_hook_guards:
        # the global registries: same reasoning, the *_with_kwargs/*_always_called
        # dicts change only together with _global_forward_hooks
        for name, d in global_hook_items():
            add_dict(d, f"torch.nn.modules.module.{name}")
    seen_flags: set[int] = set()
    for module, value in list(capture.branched_training) + list(extra_flags):
        if id(module) in seen_flags:
            continue
        seen_flags.add(id(module))
        guards.flags.append((module, bool(value)))
    for module, value in guards.flags:
        guards.names.append(f"{module_label(module, names)}.training == {value}")
    guards.values = tree_specs
    guards.names += tree_names
    if reads is not None:
        _add_value_guards(guards, reads)
    return guards


@dataclass
class ReadContext:
    """What the miss path knows about a capture beyond the Capture itself."""
    global_state: tuple[Any, tuple[Any, ...]]  # (GlobalStateGuard, its spec)
    found: state_guards.StateGuardSet         # value guards (walk_state)


def walk_state(capture: Any, root: Optional[torch.nn.Module], recorder: Any, fn: Any,
               arguments: list[tuple[str, Any]]) -> state_guards.StateGuardSet:
    """The value guards of a capture: what the code that ran could read."""
    labels = module_names(root)
    if root is not None:
        for name, tensor in root.named_parameters(remove_duplicate=False):
            labels.setdefault(id(tensor), f"self.{name}")
        for name, tensor in root.named_buffers(remove_duplicate=False):
            labels.setdefault(id(tensor), f"self.{name}")
    spec = capture.runner_spec
    attr_tensors = [v for v in (spec.attr_values.values() if spec is not None else ())
                    if isinstance(v, torch.Tensor)]
    identity_keyed = [(name, obj) for name, value in arguments
                      for obj in state_guards.identity_keyed(value)]
    return state_guards.build_state_value_guards(
        recorder, root, capture.visited_modules, fn, identity_keyed, labels,
        guard_tensor_metadata=bool(getattr(capture, "read_metadata", False)),
        attr_tensors=attr_tensors,
        metadata_tensors=getattr(capture, "metadata_tensors", ()),
    )


def _add_value_guards(guards: StateGuards, reads: ReadContext) -> None:
    guards.values += [reads.global_state[1], *reads.found.specs]
    guards.names += ["global torch state (autocast, default dtype, deterministic "
                     "algorithms, inference mode, ...)", *reads.found.names]
    guards.not_guarded = reads.found.truncated
