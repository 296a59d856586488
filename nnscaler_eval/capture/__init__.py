"""Capture of one forward call: a concrete tracer that runs it once, for real.

The C side intercepts a forward frame on a cache miss and calls `capture()` with the
frame's bound argument slots. The tracer runs the (rewritten) function once with the
real values, under a `TorchFunctionMode` that records every torch-level call into a
`torch.fx.Graph`; the run's result and side effects are the call's own (BatchNorm
statistics and counters are updated once, not twice). `Capture.make_runner()` then
turns the graph into the flat function the C hit path calls.

How values become graph values:

- tensors are tracked by identity (`id` -> producing node; every tensor seen is kept
  alive until the trace ends so ids are not reused). Tensor leaves of the slots are
  placeholders; parameters and buffers of the root's tree are `get_attr` nodes by
  qualified name (so in-place optimizer updates are seen without recapture); any
  other tensor met is a constant attribute.
- `module.training` is a `TrainingFlag` for the length of the trace (see
  tracked_values). Used as a value it becomes one placeholder per module, after the
  tensor placeholders (`Capture.training_inputs`); used to branch it specialises the
  graph (`Capture.branched_training`, which the caller guards).
- non-tensor results of metadata queries (`x.shape`, `x.dim()`, `x.dtype`) are
  constants: the caller guards input shapes. Tensors whose shape depends on data
  (`nonzero`, boolean masks, `unique`) are marked, and a shape query on them is a
  fallback instead of a baked constant.
- anything whose Python value depends on tensor data, and Python side effects that a
  replay would lose, end the capture with a `Fallback` (the run still finishes for
  real), or raise `GraphBreakError` at once with `fullgraph=True`.

Design note, submodules: calls are seen through a patched `nn.Module.__call__`
(trace_patches) and inlined, unless the module has call hooks: then it is one opaque
`call_module` node, called for real (its hooks run) with recording suspended and with
the real `training` values restored for its subtree, so no flag leaks into code that
is not being recorded.

Known limits are listed in `Capture`'s docstring.

The parts, one concern a module; the Tracer composes the others, none imports it:

- tracer.py        the Tracer (a TorchFunctionMode) and `capture()`: runs the forward,
                   takes trace_patches' callbacks, records each call
- calls.py         call classification: how a torch call is written, which results are
                   constants or graph breaks, which module calls run opaque
- nodes.py         tensor-to-node mapping: identity maps, placeholders, get_attr
                   targets and constants of the root graph
- training.py      training flags and module state: flags per module, branches taken,
                   state snapshots, numbers computed from flags
- cond.py          torch.cond: both branches traced on fake tensors into subgraphs
- branches.py      `if` and `while` on tensors from the bytecode: torch.cond and
                   while_loop nodes, the side or loop run for real, bound at the join
- checked.py       what a side or loop body traced on fakes may do (side-effect screens)
- loops.py         while_loop nodes: the graphs, carried-value checks, explicit while_loop
- dynamic.py       symbolic sizes and ints: which, the fake arguments, expressions
                   as nodes, the shape-guard program
- global_state.py  grad mode and autocast, synced into the graph before each node
- output.py        output assembly: the output layout and the finished Capture
- inputs.py        which arguments can be graph inputs (`input_fallback`)
- results.py       what a capture hands back: Capture, Fallback, GraphBreakError
"""

from nnscaler_eval.capture.calls import takes_eval_fast_path
from nnscaler_eval.capture.inputs import input_fallback
from nnscaler_eval.capture.results import Capture, Fallback, GraphBreakError
from nnscaler_eval.capture.tracer import Tracer, capture

__all__ = ["Capture", "Fallback", "GraphBreakError", "Tracer", "capture", "input_fallback",
           "takes_eval_fast_path"]
