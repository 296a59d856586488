"""What a capture hands back: a `Capture`, or the `Fallback` saying why there is no graph.

`GraphBreakError` is the `Fallback` raised at once, for callers that asked for
`fullgraph=True`; `RecordingAborted` is internal to the tracer's modules: a graph break
happened while one node was being built, and that node is not recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from nnscaler_eval.runners import codegen, module_calls
from nnscaler_eval.runners.codegen import RunnerSpec
from nnscaler_eval.runtime import ifexpr

MISSING_VALUE: Any = object()   # an attribute absent before the call (state_writes)


@dataclass
class Fallback:
    """Why a frame cannot be captured, and the user's line that made it so."""

    reason: str
    filename: str
    lineno: int
    # A later capture of the same call can do better (hook_nodes: forward hooks now
    # followed): not cached, so the next call captures again.
    retry: bool = False

    def __str__(self) -> str:
        return f"{self.reason} at {self.filename}:{self.lineno}"


class GraphBreakError(RuntimeError):
    """Raised instead of falling back when the caller asked for `fullgraph=True`."""

    def __init__(self, fallback: Fallback) -> None:
        super().__init__(
            f"cannot capture the whole forward in one graph (fullgraph=True): {fallback}"
        )
        self.fallback = fallback


class RecordingAborted(Exception):
    """Internal: a graph break happened while building a node; stop recording it."""


@dataclass
class Capture:
    """The outcome of tracing one call.

    `graph_module` computes a flat tuple (the tensor and tracked-number leaves of the
    output); `make_runner` rebuilds the forward's real output structure around it.
    Placeholders: every tensor leaf of the slots, in slot order, then one bool per
    module in `training_inputs`.

    Keep the runner, not the Capture, in a cache: `graph_module` and `runner_spec`
    hold the root's submodules (the runner reaches them through its root slot).

    Known limits:
    - a flag or tracked number read directly by C code (`math.sqrt(p)`,
      `range(self.training)`, `x is True`) is specialised without a recorded branch;
      a flag handed to a C function with a `bool` parameter other than those
      trace_patches wraps (`x.requires_grad_(self.training)`) raises TypeError;
    - a tensor made outside torch function dispatch (a C extension, the legacy
      `torch.Tensor(...)` constructor, a `DisableTorchFunction` region) is a fallback
      when it has a grad_fn, else it is taken for a constant;
    - `torch.cond` branches are traced on fake tensors (see `cond.trace_cond`):
      Python side effects inside a branch happen at trace time only; activation
      checkpointing is inlined (same values and gradients, not its memory savings);
    - module state mutated inside a list/dict attribute is caught one level deep only;
      tensors hidden in non-pytree input objects are refused (fallback), not traced;
      `random`, `time`, logging and other Python-level effects are baked in or lost.

    Threads: `module.training` is a flag on the tracing thread only (trace_patches'
    descriptor); other threads using the same modules meanwhile see their bools.
    """

    result: Any
    graph_module: Optional[fx.GraphModule]
    fallback: Optional[Fallback]
    training_inputs: list[nn.Module]
    branched_training: list[tuple[nn.Module, bool]]
    visited_modules: list[nn.Module]
    opaque_modules: list[nn.Module]
    slot_names: tuple[str, ...]
    runner_spec: Optional[RunnerSpec] = field(default=None, repr=False)
    _example_inputs: list[Any] = field(default_factory=list, repr=False)
    # Python read tensor metadata (a dtype, a shape) that went into the graph as a
    # constant: then parameters' and constants' metadata is guarded too.
    read_metadata: bool = False
    # Tensors whose metadata Python read without the graph using them (a parameter
    # read for its shape only): guarded with the others when they are module state.
    metadata_tensors: list[torch.Tensor] = field(default_factory=list, repr=False)
    # Tensors made constants of the graph that no op of the trace made and that no
    # visited module held before the call: state only if the state walk finds them
    # (a global, a closure cell, a default); else computed in this run where the trace
    # could not see it (torch.no_grad leaves no grad_fn to tell), and not replayable.
    unproven_constants: list[torch.Tensor] = field(default_factory=list, repr=False)
    # Plain values the forward wrote to module attributes (`self.shift_size = 0`),
    # each `(module, name, value before the call, value written last)`: the runner
    # writes them again on every hit; the guards are built on the values before.
    state_writes: list[tuple[nn.Module, str, Any, Any]] = field(default_factory=list, repr=False)
    # Submodule calls traced inline, as (path, class, forward's code), indexed by the
    # `meta["nnscaler_calls"]` of the nodes made in them (runners/block_reuse.py).
    inline_calls: list[tuple[Optional[str], type, Any]] = field(default_factory=list,
                                                                repr=False)
    # `if` statements on tensors the trace met: converted to torch.cond, or why not
    # (capture/branches.py, BranchNote)
    branch_notes: list[Any] = field(default_factory=list)

    @contextlib.contextmanager
    def state_before_writes(self) -> Iterator[None]:
        """The written attributes as they were before the call, for as long as the
        guards are being built (they describe the state a later call must start
        from), then as the forward left them."""
        for module, name, before, _ in reversed(self.state_writes):
            if before is MISSING_VALUE:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = before
        try:
            yield
        finally:
            for module, name, _, value in self.state_writes:
                module.__dict__[name] = value

    def make_runner(
        self, compiled: Optional[Callable[..., Any]] = None, *, training_folded: bool = False
    ) -> Callable[..., Any]:
        """`runner(*slots, *training_flags) -> output`, equal to running the forward.

        With `compiled=None` the runner is the graph itself as straight-line Python (the
        "eager" backend). Otherwise `compiled(*placeholders)` is a backend's compiled
        graph: the runner extracts the placeholders from the slots, calls it, and
        rebuilds the output structure. `training_folded=True`: `compiled` was made from
        `backend_graph()`, whose placeholders are the tensor inputs only; the runner
        still takes the flags (and ignores them).
        """
        spec = self._spec()
        if training_folded:
            spec = dataclasses.replace(spec, graph=self._folded_graph().graph)
        return codegen.make_runner(spec, compiled)

    def backend_graph(self) -> tuple[fx.GraphModule, list[Any]]:
        """The graph and example inputs to hand a `torch.compile` backend.

        Training flags are folded to this run's values (`ifexpr` nodes resolved): AOT-
        based backends (aot_eager, inductor) bake non-tensor inputs in from the example
        values anyway, silently. So with this graph every module of `training_inputs`
        needs a guard on its flag, exactly like `branched_training`; use
        `make_runner(compiled, training_folded=True)`.
        """
        folded = self._folded_graph()
        tensors = len(self._example_inputs) - len(self.training_inputs)
        return folded, self._example_inputs[:tensors]

    def _spec(self) -> RunnerSpec:
        if self.runner_spec is None:
            raise RuntimeError(
                f"this capture fell back to eager ({self.fallback}); it has no graph to run"
            )
        return self.runner_spec

    def _folded_graph(self) -> fx.GraphModule:
        spec = self._spec()
        assert self.graph_module is not None
        tensors = len(self._example_inputs) - len(self.training_inputs)
        flag_values = iter(self._example_inputs[tensors:])
        graph = fx.Graph()
        env: dict[fx.Node, Any] = {}
        for node in spec.graph.nodes:
            if node.op == "placeholder" and node.meta.get("nnscaler_input") is None:
                env[node] = next(flag_values)
            elif node.op == "call_function" and node.target is ifexpr:
                cond, true_value, false_value = fx.node.map_arg(node.args, env.__getitem__)
                if isinstance(cond, fx.Node):  # a condition the graph computes: keep it
                    env[node] = graph.node_copy(node, env.__getitem__)
                else:
                    env[node] = true_value if cond else false_value
            elif node.op == "call_module":
                # The node is nn.Module.__call__ (fx would call a class's own).  And a
                # call of the module through a function of ours, not a call_module node:
                # AOTAutograd's cache takes call_module nodes for torch's own layers,
                # which Dynamo puts there, and keys them by the module's class and
                # attributes; an opaque module of ours runs user code (hooks, its
                # forward) that no key sees, so the cache must refuse the graph.
                module = graph.get_attr(str(node.target))
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = graph.call_function(module_calls.module_call, (module, *args), kwargs)
                env[node].meta = dict(node.meta)
            else:
                env[node] = graph.node_copy(node, env.__getitem__)
        # The copy reads its attributes from the capture's own GraphModule, which
        # holds the live parameters (and never writes to the user's modules).
        return fx.GraphModule(self.graph_module, graph, class_name=type(self.graph_module).__name__)

    def runner_source(self, compiled: Optional[Callable[..., Any]] = None) -> str:
        """The runner's generated source (for logs, `explain`, tests)."""
        return codegen.runner_source(self._spec(), compiled)[0]

    def example_inputs(self) -> list[Any]:
        """The placeholder values of the traced run, in placeholder order (for backends)."""
        return list(self._example_inputs)
