"""Global torch state, grad mode and autocast, as the graph sees it versus as the run has it.

The tracer does not record `no_grad().__enter__` and friends: before each node it
compares the run's state with the graph's and, where they differ, records the change
(`set_grad_enabled`, `_enter_autocast` / `_exit_autocast`). That also sees changes
made without a torch call, and `with` blocks come out as set / restore pairs.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from nnscaler_eval.tracing import trace_patches
from nnscaler_eval.tracing.locations import record_source

AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state(device: str) -> tuple[bool, torch.dtype, bool]:
    return (
        torch.is_autocast_enabled(device),
        torch.get_autocast_dtype(device),
        torch.is_autocast_cache_enabled(),
    )


class GlobalState:
    """The state at the trace's entry, and the state the graph has reached so far."""

    def __init__(self) -> None:
        self.entry_grad_mode = torch.is_grad_enabled()
        self.graph_grad_mode = self.entry_grad_mode
        self.entry_inference_mode = torch.is_inference_mode_enabled()
        self.entry_autocast = {d: autocast_state(d) for d in AUTOCAST_DEVICES}
        self.graph_autocast = dict(self.entry_autocast)
        self.open_autocast: dict[str, fx.Node] = {}

    def for_branch(self) -> "GlobalState":
        """The state a torch.cond branch's graph starts from: the run's, as the
        enclosing graph has it now; autocast regions of its own only."""
        branch = copy.copy(self)
        branch.graph_autocast = dict(self.graph_autocast)
        branch.entry_autocast = dict(self.graph_autocast)
        branch.open_autocast = {}
        return branch

    def inference_mode_changed(self) -> bool:
        return torch.is_inference_mode_enabled() != self.entry_inference_mode

    def sync(self, graph: fx.Graph) -> None:
        """Make `graph`'s grad mode and autocast state match the run's, before a node."""
        mode = torch.is_grad_enabled()
        if mode != self.graph_grad_mode:
            node = graph.call_function(trace_patches.REAL_SET_GRAD_ENABLED, (mode,))
            record_source(node)
            self.graph_grad_mode = mode
        for device in AUTOCAST_DEVICES:
            state = autocast_state(device)
            if state == self.graph_autocast[device]:
                continue
            opened = self.open_autocast.pop(device, None)
            if opened is not None:
                record_source(
                    graph.call_function(torch.amp.autocast_mode._exit_autocast, (opened,))
                )
            if state != self.entry_autocast[device]:
                enabled, dtype, cache = state
                self.open_autocast[device] = graph.call_function(
                    torch.amp.autocast_mode._enter_autocast, (device, dtype, enabled, cache)
                )
                record_source(self.open_autocast[device])
            self.graph_autocast[device] = state
