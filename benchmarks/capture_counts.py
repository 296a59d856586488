"""Captures against torch.compile's graphs for shapes that vary (issue 32's cases).

Per case, the same calls through ours (`nnscaler.compile`, default options) and through
`torch.compile(backend="eager")` (Dynamo's capture with no compiler behind it): ours
reports captures and the calls that ran eagerly (`cache_info`), Dynamo the graphs it
made (`counters["stats"]["unique_graphs"]`) and its graph breaks.  Every output is
compared with eager's; a case whose answers differ is marked, and so is one where
Dynamo raises.  Each case runs in a fresh process.

    .venv/bin/python -m benchmarks.capture_counts [--cases packed_lstm,t5_generate,...]

The cases are the tests' own (tests/test_data_dependent_shapes.py,
tests/test_symbolic_ops.py, tests/test_argument_objects.py), so the figures describe
what the tests check.  Not a test: it reports; counts, not timings.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import warnings
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

import nnscaler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

Run = Callable[[Any], list]   # a model (ours, Dynamo's or eager) -> its outputs


def _forward_calls(calls: list) -> Run:
    return lambda model: [model(*args) for args in calls]


def _cases() -> dict[str, tuple[Callable[[], Any], Run, bool]]:
    """name -> (make the model, run the calls, compile `forward` rather than the module
    for Dynamo: generate() calls the module's own forward)."""
    import test_argument_objects as objects
    import test_data_dependent_shapes as data
    import test_symbolic_ops as symbolic

    cases: dict[str, tuple[Callable[[], Any], Run, bool]] = {}
    for name, (module, calls, _ops) in data.CASES.items():
        cases[name] = (lambda m=module: copy.deepcopy(m), _forward_calls(calls), False)
    for name, (make, shapes) in symbolic.CASES.items():
        calls = [(torch.randn(*shape),) for shape in shapes]
        cases[name] = (make, _forward_calls(calls), False)

    def lm_training(model: Any) -> list:
        out = []
        for length in (8, 9, 12, 17, 5, 30, 3, 24):
            ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
            torch.manual_seed(length)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            out.append(loss.detach())
        return out

    for kind in ("llama", "gpt2"):
        cases[f"{kind}_train_labels"] = (lambda k=kind: symbolic._causal_lm(k).train(),
                                         lm_training, False)

    def generate(model: Any) -> list:
        out = []
        for length in (5, 7, 9, 12, 6, 15, 2):
            ids = torch.randint(3, 64, (1, length), generator=torch.Generator().manual_seed(length))
            out.append(model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False))
        return out

    for kind in ("t5", "bart"):
        cases[f"{kind}_generate"] = (lambda k=kind: objects._seq2seq(k), generate, True)

    def hidden_states(model: Any) -> list:
        out = []
        for length in (6, 9, 13, 4, 20):
            ids = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(length))
            result = model(input_ids=ids, output_hidden_states=True, output_attentions=True,
                           use_cache=False)
            out.append((result.logits, result.hidden_states, result.attentions))
        return out

    def llama_eval() -> Any:
        model = symbolic._causal_lm("llama").eval()
        model.config._attn_implementation = "eager"   # attentions are returned
        return model

    cases["llama_hidden_states"] = (llama_eval, hidden_states, False)
    return cases


def _same(a: Any, b: Any) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.shape == y.shape
                    and torch.allclose(x.float(), y.float(), rtol=1e-4, atol=1e-5)):
                return False
        elif x != y:
            return False
    return True


def _measure(make: Callable[[], Any], run: Run, forward_only: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    eager = make()
    want = run(copy.deepcopy(eager))

    ours = nnscaler.compile(copy.deepcopy(eager))
    got = run(ours)
    info = nnscaler.cache_info(ours)
    row: dict[str, Any] = dict(captures=info.captures, eager_calls=info.fallbacks,
                               ours_equal=_same(got, want))

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    theirs = copy.deepcopy(eager)
    if forward_only:
        theirs.forward = torch.compile(theirs.forward, backend="eager")
    else:
        theirs = torch.compile(theirs, backend="eager")
    try:
        got = run(theirs)
    except Exception as error:   # Dynamo's own failure is a figure of the row
        print(f"Dynamo raised: {type(error).__name__}: {str(error)[:2000]}", file=sys.stderr)
        row.update(dynamo_graphs="-", dynamo_breaks="-",
                   dynamo_equal=f"raised {type(error).__name__}")
    else:
        row.update(dynamo_graphs=counters["stats"]["unique_graphs"],
                   dynamo_breaks=sum(counters["graph_break"].values()),
                   dynamo_equal=_same(got, want))
    torch._dynamo.reset()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated names (default: all)")
    parser.add_argument("--one", help=argparse.SUPPRESS)   # a child: one case, JSON out
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    cases = _cases()
    if args.one:
        print(json.dumps(_measure(*cases[args.one])))
        return
    names = args.cases.split(",") if args.cases else list(cases)
    unknown = sorted(set(names) - set(cases))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(cases)}")
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}.  Each case in a fresh process.\n")
    print("| case | ours: captures | ours: calls run eagerly | Dynamo: graphs | "
          "Dynamo: graph breaks | eager's answers (ours / Dynamo) |")
    print("|---|---|---|---|---|---|")
    for name in names:
        # a fresh process per case: Dynamo's state after one case's failure must not
        # decide the next one's
        child = subprocess.run([sys.executable, "-m", "benchmarks.capture_counts", "--one", name],
                               capture_output=True, text=True)
        if child.returncode != 0:
            sys.stderr.write(child.stderr)
            print(f"| {name} | failed (exit {child.returncode}) | | | | |", flush=True)
            continue
        sys.stderr.write(child.stderr)
        row = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"| {name} | {row['captures']} | {row['eager_calls']} | {row['dynamo_graphs']} | "
              f"{row['dynamo_breaks']} | {_verdict(row['ours_equal'])} / "
              f"{_verdict(row['dynamo_equal'])} |", flush=True)


def _verdict(equal: Any) -> str:
    return equal if isinstance(equal, str) else "yes" if equal else "NO"


if __name__ == "__main__":
    main()
