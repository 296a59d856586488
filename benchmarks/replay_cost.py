"""What a hit of a graph-replay entry costs the host, on the CPU: the bookkeeping of
`_C.GraphReplay` (csrc/graph_replay.c) around a recording that does nothing, against
the Python replay it replaced and against eager.

    .venv/bin/python -m benchmarks.replay_cost [--repeats 15] [--loops 2000]

A CUDA graph's replay is one driver call; everything else a hit does is host work:
the key and guards, the copies into the static buffers, the output clones.  Without a
GPU that work is measured here with a stand-in recording that does nothing (no
kernel runs), on `nn.Linear(8, 8)` + ReLU at batch 1 under no_grad (one input copied
in, one output cloned):

- `ours, C replay`: `backends.replayed(...)`: the entry's runner is the replay itself
  (the hit runs no Python frame of ours);
- `ours, Python replay`: the same bookkeeping as the Python closure this project used
  before (a generated runner calling it);
- `eager`: the forward itself (its two kernels run; on a GPU they would be launches);
- `torch.compile(backend="eager")`: Dynamo's guards and its graph, for scale;
- at batch 5, a dynamic capture (`dynamic=True`), recorded per size: its generated
  runner looks the size up and calls the size's replay; and with `size_buckets=True`,
  the size runs the recording of bucket 8 (`size_buckets.PaddedCall`: the argument
  copied into the buffer's first 5 rows, the output cut back), beside eager at batch 5.

Thread CPU time per call (`time.thread_time_ns`), median of `--repeats` loops of
`--loops` calls, one intra-op thread.  On a GPU, `make gpu-check` measures the real
thing (benchmarks/gpu.py).
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn as nn


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


def _noop_record(gm: Any, static_inputs: list[Any]) -> tuple[Callable[[], None], Any]:
    return (lambda: None), gm(*static_inputs)


def _c_replay(gm: Any, example_inputs: list[Any]) -> Any:
    from nnscaler_eval.runners import backends
    backends.refuse_replay(gm, example_inputs, "cpu")   # as "cudagraphs": concrete sizes
    return backends.replayed(gm, example_inputs, _noop_record)


def _python_replay(gm: Any, example_inputs: list[Any]) -> Any:
    static_inputs = [t.clone() for t in example_inputs]
    static_outputs = gm(*static_inputs)
    run = (lambda: None)

    def replay(*inputs: Any) -> Any:
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value)
        run()
        return tuple(o.clone() for o in static_outputs)

    return replay


def _per_call_ns(fn: Callable[[], Any], repeats: int, loops: int) -> float:
    for _ in range(loops // 10):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.thread_time_ns()
        for _ in range(loops):
            fn()
        samples.append((time.thread_time_ns() - start) / loops)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--loops", type=int, default=2000)
    args = parser.parse_args()
    import nnscaler

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _Net().eval()
    x, x5 = torch.randn(1, 8), torch.randn(5, 8)
    variants = {
        "eager": (model, x),
        "ours, C replay": (nnscaler.compile(copy.deepcopy(model), backend=_c_replay), x),
        "ours, Python replay": (nnscaler.compile(copy.deepcopy(model), backend=_python_replay),
                                x),
        "torch.compile(backend=\"eager\")": (torch.compile(copy.deepcopy(model),
                                                           backend="eager"), x),
        "eager, batch 5": (model, x5),
        "ours, batch 5, per size": (nnscaler.compile(copy.deepcopy(model), backend=_c_replay,
                                                     dynamic=True), x5),
        "ours, batch 5, bucket 8": (nnscaler.compile(copy.deepcopy(model), backend=_c_replay,
                                                     dynamic=True, size_buckets=True), x5),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for name, (m, arg) in variants.items():
            torch.testing.assert_close(m(arg), model(arg))
        for _ in range(3):   # interleaved rounds
            for name, (m, arg) in variants.items():
                results[name].append(_per_call_ns(lambda m=m, arg=arg: m(arg), args.repeats,
                                                  args.loops))
    print(f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}; thread CPU per call, median of "
          f"3 interleaved rounds of {args.repeats} x {args.loops} calls")
    for name, values in results.items():
        eager = statistics.median(results["eager, batch 5" if "batch 5" in name else "eager"])
        median = statistics.median(values)
        print(f"  {name:34s} {median / 1000:6.2f} us  x{median / eager:.2f} eager"
              f"{' at batch 5' if 'batch 5' in name else ''}")


if __name__ == "__main__":
    main()
