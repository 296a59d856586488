"""Runner call overhead and capture cost, side by side with eager PyTorch.

    .venv/bin/python benchmarks/tracer_overhead.py [--quick]

Measures, on one CPU thread, each comparison between two things of the same scope:
- nn.Linear(8, 8) at batch 1, with and without grad: the runner `capture()` generated
  against eager's body (`type(m).forward(m, x)`: neither goes through
  `nn.Module.__call__` or any guard); the compiled module's call
  (`nnscaler.compile(m, backend="eager")`: key, guards and runner) against eager's
  module call; and the bare `F.linear` both end in (the floor);
- a transformer block: capture (trace) time, runner generation time, and the runner
  against eager's body.
Wall time: medians over rounds, the cases of a round in a rotated order (no case
always runs first); ratios within the same scope only.
"""

from __future__ import annotations

import argparse
import inspect
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from nnscaler_eval.runtime import ifexpr
from nnscaler_eval.capture import Capture, capture


class Block(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(p)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        p = ifexpr(self.training, self.p, 0.0)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.mlp(self.ln2(x))


def capture_module(module: nn.Module, *args: Any) -> Capture:
    forward = type(module).forward
    names = tuple(inspect.signature(forward).parameters)[: 1 + len(args)]
    return capture(forward, (module, *args), names, root=module)


def interleaved_medians(
    cases: dict[str, Callable[[], Any]], calls: int, rounds: int
) -> dict[str, float]:
    """Median ns per call of each case, the cases measured in turn each round, each
    round starting one case later."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for case in cases.values():
        for _ in range(max(calls // 5, 10)):
            case()
    order = list(cases.items())
    for round_ in range(rounds):
        for name, case in order[round_ % len(order):] + order[:round_ % len(order)]:
            start = time.perf_counter_ns()
            for _ in range(calls):
                case()
            samples[name].append((time.perf_counter_ns() - start) / calls)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    torch.set_num_threads(1)
    calls, rounds = (1000, 7) if quick else (5000, 31)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(
                line.split(":", 1)[1].strip() for line in info if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    print(f"# {cpu}; Python {platform.python_version()}; torch {torch.__version__}; 1 thread")

    linear, x = nn.Linear(8, 8), torch.randn(1, 8)
    runner = capture_module(linear, x).make_runner()
    compiled = nnscaler.compile(nn.Linear(8, 8), backend="eager")
    compiled.load_state_dict(linear.state_dict())
    weight, bias, f_linear = linear.weight, linear.bias, torch._C._nn.linear
    body = type(linear).forward
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            compiled(x), compiled(x)   # captured before timing
            medians = interleaved_medians(
                {
                    "eager body": lambda: body(linear, x),
                    "runner": lambda: runner(linear, x),
                    "eager module call": lambda: linear(x),
                    "compiled call": lambda: compiled(x),
                    "bare F.linear": lambda: f_linear(x, weight, bias),
                },
                calls,
                rounds,
            )
        m = medians
        bare = m["bare F.linear"]
        print(
            f"Linear(8,8) b=1 grad={grad}: bodies: eager {m['eager body']:.0f} ns, runner "
            f"{m['runner']:.0f} ns ({m['runner'] / m['eager body']:.2f}x) | calls: eager "
            f"{m['eager module call']:.0f} ns, compiled {m['compiled call']:.0f} ns "
            f"({m['compiled call'] / m['eager module call']:.2f}x) | bare op {bare:.0f} ns; "
            f"over the op: runner {m['runner'] - bare:+.0f}, eager body "
            f"{m['eager body'] - bare:+.0f}, compiled call {m['compiled call'] - bare:+.0f}, "
            f"eager call {m['eager module call'] - bare:+.0f} ns"
        )

    block, xb = Block(), torch.randn(2, 16, 64)
    trace_times = []
    for _ in range(3 if quick else 11):
        start = time.perf_counter()
        block_capture = capture_module(block, xb)
        trace_times.append(time.perf_counter() - start)
    start = time.perf_counter()
    block_runner = block_capture.make_runner()
    generate = time.perf_counter() - start
    flags = [bool(m.training) for m in block_capture.training_inputs]
    nodes = len(block_capture.graph_module.graph.nodes) if block_capture.graph_module else 0
    print(
        f"Block(dim=64) capture: median {statistics.median(trace_times) * 1e3:.1f} ms "
        f"(first {trace_times[0] * 1e3:.1f} ms), {nodes} nodes; make_runner {generate * 1e3:.1f} ms"
    )
    block_body = type(block).forward
    medians = interleaved_medians(
        {"eager body": lambda: block_body(block, xb),
         "runner": lambda: block_runner(block, xb, *flags)},
        max(calls // 50, 20),
        rounds,
    )
    print(
        f"Block(dim=64) body: eager {medians['eager body'] / 1e3:.1f} us | runner "
        f"{medians['runner'] / 1e3:.1f} us "
        f"({medians['runner'] / medians['eager body']:.2f}x eager's body)"
    )


if __name__ == "__main__":
    sys.exit(main())
