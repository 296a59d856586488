"""State-guard cost per hit: ours vs Dynamo's guard check, for GPTs of 1, 12 and 48
blocks and tiny HF gpt2 (run it on two checkouts for before/after, and per CPython:
on 3.12+ an entry whose dicts are unchanged is one clock comparison, compat.h).

    python -m benchmarks.state_guard_cost [--repeats 9] [--depths 1,12,48]

What is timed, per call, interleaved, median over repeats (thread CPU time):
- ours: `entry.check_verbose()` of the root's cache entry: exactly the hit path's C
  check of the state guards (module tree and hook dicts by version, training flags,
  value guards, global torch state) plus one METH_NOARGS call; the per-call key and
  the lookup are not included;
- dynamo: `entry.guard_manager.root.check(f_locals)` of the entry Dynamo made for the
  same forward (`torch.compile(backend="eager")`): its whole C++ guard tree, tensor
  guards on the inputs included, plus one pybind call.
These are NOT the same scope, and no ratio is printed: Dynamo's check includes its
guards on the input tensors, ours leaves out the per-call key over the inputs and the
lookup (no Python entry point times them alone).  `make bench-ir`
(benchmarks/bench_ir.py) compares the same scope on both sides, in instructions: ours =
bucket + per-call key + lookup with the state guards, Dynamo = its lookup; README.md
quotes those figures.  This script stays for before/after timings of our state guards.
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
import warnings
from typing import Any, Callable

import torch

from benchmarks import models


def _per_call_us(fn: Callable[..., Any], arg: Any, n: int) -> float:
    start = time.thread_time_ns()
    for _ in range(n):
        fn(arg)
    return (time.thread_time_ns() - start) / n / 1000


def _ours_entry(module: torch.nn.Module) -> Any:
    import nnscaler_eval
    from nnscaler_eval import _C
    forward = type(module).forward
    while forward is not None:   # a decorated forward: the bucket is on one of its codes
        for bucket in (_C.code_state(forward.__code__) or {}).get("buckets", []):
            if bucket.self is module and bucket.entries:
                return bucket.entries[0]
        forward = getattr(forward, "__wrapped__", None)
    raise RuntimeError(f"no cache entry for {type(module).__name__} ({nnscaler_eval.__file__})")


def _dynamo_entry(module: torch.nn.Module) -> Any:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    forward = type(module).forward
    while forward is not None:   # a decorated forward: Dynamo caches on the outer code
        entries = _debug_get_cache_entry_list(forward.__code__)
        if entries:
            return entries[0]
        forward = getattr(forward, "__wrapped__", None)
    raise RuntimeError("Dynamo made no cache entry for the forward")


def _cases(depths: list[int]) -> list[tuple[str, torch.nn.Module, dict]]:
    cases = []
    for depth in depths:
        gpt, (idx,) = models.build(f"gpt{depth}", 1)
        cases.append((f"{depth}-block GPT", gpt.eval(), {"idx": idx}))
    try:
        import transformers
        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=64, use_cache=False)
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        cases.append(("tiny HF gpt2", hf, {"input_ids": torch.randint(0, 64, (1, 8))}))
    except ImportError:
        print("transformers is not installed: the gpt2 row is left out")
    return cases


def main() -> None:
    import nnscaler
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--depths", default="1,12,48",
                        help="GPT depths (blocks) to measure, comma-separated")
    options = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(f"# state-guard check per hit; {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"nnscaler_eval from {nnscaler.__file__}")
    print("| model | ours: state guards, no input key (us) | "
          "torch.compile(backend='eager'): guard check with input guards (us) |")
    print("|---|---|---|")
    with torch.no_grad():
        for name, module, inputs in _cases([int(d) for d in options.depths.split(",")]):
            ours = nnscaler.compile(copy.deepcopy(module))
            plain = copy.deepcopy(module)
            dynamo = torch.compile(plain, backend="eager")
            for _ in range(2):
                ours(**inputs)
                dynamo(**inputs)
            entry = _ours_entry(ours)
            assert entry.check_verbose() is None, entry.check_verbose()
            d_entry = _dynamo_entry(plain)
            f_locals = {"self": plain, **inputs}
            d_check = d_entry.guard_manager.root.check
            if not d_check(f_locals):   # a decorated forward: wrapper(self, *args, **kwargs)
                wrapper = type(plain).forward
                free = dict(zip(wrapper.__code__.co_freevars,
                                (c.cell_contents for c in wrapper.__closure__ or ())))
                f_locals = {"self": plain, "args": (), "kwargs": dict(inputs), **free}
            if not d_check(f_locals):
                raise RuntimeError(f"{name}: Dynamo's guards fail on the f_locals given")
            samples: dict[str, list[float]] = {"ours": [], "dynamo": []}
            for r in range(options.repeats):
                order = [("ours", lambda _: entry.check_verbose(), None),
                         ("dynamo", d_check, f_locals)]
                for key, fn, arg in (order if r % 2 == 0 else order[::-1]):
                    samples[key].append(_per_call_us(fn, arg, options.calls))
            o, d = statistics.median(samples["ours"]), statistics.median(samples["dynamo"])
            print(f"| {name} | {o:.2f} | {d:.2f} |")


if __name__ == "__main__":
    main()
