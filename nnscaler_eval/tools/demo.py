"""`make demo`: compile a small transformer with dropout and `self.training`
expressions, run train and eval steps on CPU, and print what was captured, guarded
and measured."""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, p: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, p)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 2,
                 p: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, p) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.label_smoothing = 0.1

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        smoothing = self.label_smoothing if self.training else 0.0
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=smoothing)


def interleaved_median_ms(fns: dict, repeats: int = 15) -> dict:
    """ms per call of each of `fns`, median over `repeats`.  Every repetition runs each
    one once, the order rotated by one per repetition (ABC, BCA, CAB, ...), so a slow
    stretch of a shared machine lands on all of them alike instead of on one block."""
    names = list(fns)
    times: dict = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def print_times(label: str, ms: dict) -> None:
    base = ms["eager"]
    print(f"  {label:9s}  " + "   ".join(
        f"{name} {t:.3f} ms" + ("" if name == "eager" else f" (x{t / base:.2f})")
        for name, t in ms.items()))


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU\n")

    print("== rewrite mode: `a if self.training else b` becomes ifexpr(self.training, a, b)")
    for cls in (Attention, TinyGPT):
        code = nnscaler.rewritten_code(cls.forward)
        consts = [c for c in code.co_consts if callable(c)]
        print(f"  {cls.__name__}.forward: rewritten, calls {consts[0].__module__}.{consts[0].__name__}"
              if consts else f"  {cls.__name__}.forward: nothing to rewrite")

    eager = TinyGPT()
    model = TinyGPT()
    model.load_state_dict(eager.state_dict())
    nnscaler.compile(model)
    idx = torch.randint(0, 128, (8, 32))
    targets = torch.randint(0, 128, (8, 32))

    print("\n== correctness: compiled vs eager, same seed")
    for mode in ("train", "eval"):
        getattr(eager, mode)()
        getattr(model, mode)()
        torch.manual_seed(1)
        a = eager(idx, targets)
        torch.manual_seed(1)
        b = model(idx, targets)
        print(f"  {mode:5s}: eager loss {a.item():.6f}  compiled loss {b.item():.6f}  "
              f"max diff {abs(a - b).item():.2e}")

    print("\n== train steps (AdamW) and eval steps, toggling train()/eval() each round")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(5):
        model.train()
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            val = model(idx, targets)
        print(f"  step {step}: train loss {loss.item():.4f}  eval loss {val.item():.4f}")
    info = nnscaler.cache_info(model)
    print(f"  cache: {info}")
    print("  (train and eval share one graph per grad mode: the training flag is a graph input)")

    print("\n== sequence lengths that vary: one symbolic capture serves them (eval, no_grad)")
    lengths = [12, 20, 7, 31, 16, 25, 9]
    varying = nnscaler.compile(copy.deepcopy(eager).eval())
    eager.eval()
    with torch.no_grad():
        worst = 0.0
        for length in lengths:
            ids = torch.randint(0, 128, (4, length))
            tgt = torch.randint(0, 128, (4, length))
            worst = max(worst, abs(varying(ids, tgt) - eager(ids, tgt)).item())
    print(f"  lengths {lengths}: {nnscaler.cache_info(varying)}, max diff {worst:.2e}")
    print("  (the first length is captured as it is; the second makes idx.size(1) and "
          "targets.size(1) symbolic)")

    print("\n== what was captured and guarded (nnscaler.explain)")
    report = nnscaler.explain(model.train(), idx, targets)
    for entry in report.entries:
        nodes = len(entry.graph_module.graph.nodes) if entry.graph_module is not None else 0
        print(f"  {entry.where}: {nodes} graph nodes, {len(entry.key)} key guards, "
              f"{len(entry.guards)} state guards")
        ifexprs = [n for n in entry.graph_module.graph.nodes if "ifexpr" in str(n.target)] \
            if entry.graph_module is not None else []
        print(f"    ifexpr nodes: {len(ifexprs)}; training inputs: "
              f"{[n.name for n in entry.graph_module.graph.nodes if n.op == 'placeholder' and 'training' in n.name]}")
        for guard in entry.key[:3] + entry.guards[:3]:
            print(f"    guard: {guard}")
    for fb in report.fallbacks:
        print(f"  fallback: {fb}")

    # One intra-op thread while timing: on a small shared machine two OpenMP threads
    # made fwd+bwd 100x slower whenever one was descheduled (benchmarks/README.md).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    print("\n== measured (ms per step, median of 15, 1 thread; eager, nnscaler and "
          "torch.compile(backend='eager') alternated every repetition)")
    dynamo_model = TinyGPT()
    dynamo_model.load_state_dict(eager.state_dict())
    dynamo = torch.compile(dynamo_model, backend="eager")
    models = {"eager": eager, "nnscaler": model, "dynamo": dynamo}
    for m in models.values():
        m.eval()
    with torch.no_grad():
        for _ in range(3):   # Dynamo compiles here; ours hits
            for m in models.values():
                m(idx, targets)
        ms = interleaved_median_ms({name: (lambda m=m: m(idx, targets))
                                    for name, m in models.items()})
    print_times("inference", ms)
    for m in models.values():
        m.train()

    def step(m):
        m(idx, targets).backward()

    for _ in range(3):
        for m in models.values():
            step(m)
    ms = interleaved_median_ms({name: (lambda m=m: step(m)) for name, m in models.items()})
    print_times("fwd+bwd", ms)
    torch.set_num_threads(threads)
    print(f"  final cache: {nnscaler.cache_info(model)}")


if __name__ == "__main__":
    main()
