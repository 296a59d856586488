"""Child program for tests/test_compiler_caches.py: compiles tiny models with a
torch.compile backend in this process and prints, per case, what torch's compiler
caches did (the cache counters of `torch._dynamo.utils.counters`) and whether every
output, gradient and buffer equalled eager's.  Run twice with one
TORCHINDUCTOR_CACHE_DIR, the second run's caches are the first run's.

    python tests/compiler_cache_worker.py SEED BACKEND:CASE [BACKEND:CASE ...]

SEED makes the weights, the constant tensor and the inputs: a second process with
another seed must hit the same cache entries (they hold code, not values) and still
give eager's answers.

BACKEND is a torch.compile backend's name; `aot_eager+cache` is aot_eager with
torch._functorch.config's force_autograd_cache and bundled_autograd_cache set for
its cases: AOTAutograd keeps its cache across processes for a backend other than
Inductor only with both, for torch.compile as for us.

Cases: `static` (train() with a BatchNorm and a `self.training` conditional: forward
and backward, then eval() under no_grad: two graphs, one per mode), `symbolic`
(dynamic=True, train() forward and backward at two batch sizes, one graph), `blocks`
(three equal blocks, shared as one subgraph by block reuse: train() forward and
backward, then eval(): two graphs).
The last line of stdout is JSON: {"BACKEND:CASE": {"counters": {...}, "equal":
bool, "captures": int, "shared": [modules sharing a subgraph, per shared block]}}.
"""
from __future__ import annotations

import contextlib
import copy
import faulthandler
import json
import sys

import torch
import torch.nn as nn

faulthandler.dump_traceback_later(900, exit=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        # a plain tensor attribute: a constant of the graph, not a buffer
        self.scale = torch.rand(8) + 0.5

    def forward(self, x):
        y = self.bn(self.fc(x)).relu() * self.scale
        y = y * 2 if self.training else y - 1
        with torch.no_grad():
            shift = x.mean()
        return y + shift


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {name: count for group in ("aot_autograd", "inductor")
            for name, count in counters[group].items() if "cache" in name}


def _clear() -> None:
    from torch._dynamo.utils import counters

    counters.clear()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def _step(eager: nn.Module, model: nn.Module, compiled: nn.Module, x: torch.Tensor) -> bool:
    """One forward (and backward in train()) on both; are outputs, gradients and
    buffers equal?"""
    if eager.training:
        xe, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_m = eager(xe), compiled(xm)
        out_e.square().sum().backward()
        out_m.square().sum().backward()
        equal = _same(out_e, out_m) and _same(xe.grad, xm.grad)
        equal = equal and all(_same(p.grad, q.grad) for p, q in
                              zip(eager.parameters(), model.parameters()))
        for p in (*eager.parameters(), *model.parameters()):
            p.grad = None
    else:
        with torch.no_grad():
            equal = _same(eager(x), compiled(x))
    return equal and all(_same(a, b) for a, b in zip(eager.buffers(), model.buffers()))


def run_case(backend: str, case: str, seed: int) -> dict:
    import nnscaler

    torch.manual_seed(seed)
    model = Blocks() if case == "blocks" else Net()
    eager = copy.deepcopy(model)
    compiled = nnscaler.compile(model, backend=backend,
                                dynamic=True if case == "symbolic" else None)
    _clear()
    equal = True
    if case in ("static", "blocks"):
        equal &= _step(eager.train(), model.train(), compiled, torch.randn(4, 8))
        equal &= _step(eager.eval(), model.eval(), compiled, torch.randn(4, 8))
        equal &= _step(eager.train(), model.train(), compiled, torch.randn(4, 8))
    elif case == "symbolic":
        for batch in (5, 7, 5):
            equal &= _step(eager, model, compiled, torch.randn(batch, 8))
    else:
        raise SystemExit(f"unknown case {case!r}")
    counters = _counters()
    shared = []
    if case == "blocks":
        model.train()
        report = nnscaler.explain(compiled, torch.randn(4, 8).requires_grad_())
        shared = [block.paths for block in report.shared_blocks]
    return {"counters": counters, "equal": bool(equal),
            "captures": nnscaler.cache_info(compiled).captures, "shared": shared}


def main() -> None:
    import torch._functorch.config as functorch_config

    torch.set_num_threads(1)
    results = {}
    seed = int(sys.argv[1])
    for spec in sys.argv[2:]:
        backend, case = spec.split(":")
        with contextlib.ExitStack() as stack:
            if backend == "aot_eager+cache":
                backend = "aot_eager"
                stack.enter_context(functorch_config.patch(
                    force_autograd_cache=True, bundled_autograd_cache=True))
            results[spec] = run_case(backend, case, seed)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
