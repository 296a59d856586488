"""Size buckets with padding for graph recordings (`compile(..., size_buckets=True)`).

A backend that records concrete sizes (CUDA graphs) records a dynamic capture once
per size (`backends.PerSizeCompiled`).  With size buckets, a call of size n runs the
recording of the next power of two S >= n instead: its arguments are copied into the
first n positions of the recording's S-sized input buffers along each padded
dimension, and its outputs are cut back to n.  That is right only where the positions
n..S-1 cannot reach the first n, and this module decides where, op by op, on the
ATen operations the graph runs (`plan()`):

- the graph runs once on its fake inputs under `padding_rules.Padding`, a dispatch
  mode that judges every ATen operation: sound when each kept position of its result
  depends only on kept positions of its operands, with the function it has at size n
  (pointwise operations, moves and views that keep a padded factor whole, reductions,
  contractions and norms over other dimensions, cumulative operations, slices from
  the front, attention that is causal over a padded sequence by `is_causal` or by a
  mask built from positions, lookups by the caller's indices or an `arange`, ...);
- a taint that reaches an output, a write in place, a Python value or a
  data-dependent size refuses that symbol, with the operation named; so do a size
  used as a number, a write to an input, and a run that fixes a symbolic size (the
  capture's ShapeEnv is put back as it was);
- symbols are tried together, then one at a time (a batch may pad where a length
  may not).

At run time (`bucket_call`, `_C.GraphReplay.for_sizes`, csrc/graph_replay.h) the
arguments go into views of the leading positions of the bucket's buffers, made once
per size, and the outputs' leading positions are cloned out, in C.  A bucket is used
only where it satisfies the capture's own shape guards (a graph traced for sizes up
to 512 is never run at 1024) and the caps above; else the call records its exact
size, as without buckets.  The padded positions of the buffers hold copies of real
arguments (the first recording's last position repeated, later calls' leftovers), so
indices read there are always valid ones.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import sympy
import torch

from nnscaler_eval.runners.padding_rules import MIXED, Padding, Refused, free_symbols, sym_expr

__all__ = ["BucketPlan", "Refused", "bucket_call", "plan"]


# -- the plan ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """Which sizes are padded and how a call's sizes map to a bucket."""
    symbols: frozenset
    # per graph input: ((dim, symbol), ...) of a tensor, a symbol for an int, or ()
    inputs: tuple
    # per output of the graph's tuple: ((dim, symbol), ...) to cut back
    outputs: tuple
    where: dict          # every symbol met in the inputs -> (input index, dim or None)
    ranges: dict         # symbol -> (lower, upper or None)
    ceiling: dict        # padded symbol -> largest bucket
    guards: tuple        # the capture's guards that name a padded symbol
    names: tuple         # the graph's input names, for words
    left_out: tuple      # (symbol, why it is not padded) for the other symbolic sizes

    def describe(self) -> str:
        parts = []
        for symbol in sorted(self.symbols, key=str):
            cap = f", at most {self.ceiling[symbol]}" if symbol in self.ceiling else ""
            parts.append(f"{_name(self.names, self.where, symbol)} ({symbol}{cap})")
        text = "pads " + ", ".join(parts) + " to power-of-two buckets"
        for symbol, why in self.left_out:
            text += f"; not {_name(self.names, self.where, symbol)}: {why}"
        return text

    def values(self, args: tuple) -> Optional[dict]:
        out = {}
        for symbol, (i, dim) in self.where.items():
            arg = args[i]
            if dim is None:
                if type(arg) is not int:
                    return None
                out[symbol] = arg
            else:
                if not isinstance(arg, torch.Tensor) or arg.dim() <= dim:
                    return None
                out[symbol] = int(arg.shape[dim])
        return out

    def bucket(self, values: dict) -> Optional[dict]:
        """The padded sizes for a call of `values`, or None: no padding needed or
        allowed (the call's own size is recorded then)."""
        target = dict(values)
        for symbol in self.symbols:
            n = values[symbol]
            size = 1 << max(n - 1, 0).bit_length()
            size = min(size, self.ceiling.get(symbol, size))
            lower, upper = self.ranges.get(symbol, (0, None))
            if upper is not None:
                size = min(size, upper)
            target[symbol] = max(size, n)
        if target == values:
            return None
        substitution = {s: sympy.Integer(v) for s, v in target.items()}
        for guard in self.guards:
            if guard.xreplace(substitution) is not sympy.true:
                return None
        return target

    def padded_args(self, args: tuple, target: dict) -> list:
        """The arguments padded to `target`: each padded dimension repeats its last
        position (a copy of a real value: an index stays a valid index)."""
        out = list(args)
        for i, dims in enumerate(self.inputs):
            if isinstance(dims, tuple):
                t = args[i]
                for dim, symbol in dims:
                    n = t.shape[dim]
                    extra = target[symbol] - n
                    if extra > 0:
                        edge = (t.narrow(dim, n - 1, 1) if n > 0
                                else t.new_zeros(t.shape[:dim] + (1,) + t.shape[dim + 1:]))
                        shape = list(t.shape)
                        shape[dim] = extra
                        t = torch.cat([t, edge.expand(shape)], dim)
                out[i] = t.contiguous()
            elif dims is not None:
                out[i] = target[dims]
        return out

    def size_key(self, args: list) -> tuple:
        return tuple(getattr(a, "shape", a) for a in args)


def bucket_call(replay: Any, plan: BucketPlan, values: dict) -> Any:
    """The bucket's recording run for a call of `values`: `replay.for_sizes` makes the
    views of its buffers' leading positions once; a call copies into them and clones
    out of them, in C (csrc/graph_replay.h)."""
    def kept(buffers: tuple, dims_of: tuple) -> tuple:
        out = []
        for buffer, dims in zip(buffers, dims_of):
            if not isinstance(dims, tuple) or not dims or not isinstance(buffer, torch.Tensor):
                out.append(None)
                continue
            sizes = list(buffer.shape)
            for dim, extent in dims:
                sizes[dim] = int(extent.xreplace({s: sympy.Integer(v) for s, v in values.items()}))
            out.append(tuple(sizes))
        return tuple(out)

    free = tuple(i for i, s in enumerate(plan.inputs) if s is not None and not isinstance(s, tuple))
    outputs = tuple(plan.outputs) + ((),) * (len(replay.outputs) - len(plan.outputs))
    return replay.for_sizes(free, kept(replay.inputs, plan.inputs), kept(replay.outputs, outputs))


def plan(gm: Any, example_inputs: list) -> BucketPlan:
    """The bucket plan of a dynamic capture's graph, or Refused saying why none."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(example_inputs)
    env = getattr(fake_mode, "shape_env", None)
    if env is None:
        raise Refused("the graph has no symbolic sizes")
    where: dict = {}
    mixed: set = set()
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                expr = sym_expr(size)
                if expr is None:
                    continue
                if isinstance(expr, sympy.Symbol):
                    where.setdefault(expr, (i, dim))
                else:
                    mixed |= expr.free_symbols
        elif sym_expr(value) is not None:
            expr = sym_expr(value)
            if isinstance(expr, sympy.Symbol):
                where.setdefault(expr, (i, None))
            else:
                mixed |= expr.free_symbols
    candidates = [s for s in where if s not in mixed and where[s][1] is not None]
    if not candidates:
        raise Refused("no input dimension has a symbolic size of its own")
    ranges = {}
    for symbol in where:
        bounds = env.var_to_range.get(symbol)
        lower = int(bounds.lower) if bounds is not None and bounds.lower.is_Integer else 0
        upper = (int(bounds.upper) if bounds is not None and bounds.upper.is_Integer
                 and int(bounds.upper) < 2 ** 62 else None)
        ranges[symbol] = (lower, upper)
    # Every symbol at once, else one at a time, keeping each that stays sound.
    names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    chosen: Optional[tuple] = None
    left_out: dict = {}
    try:
        chosen = (frozenset(candidates),) + _analyse(gm, example_inputs, fake_mode, env,
                                                     frozenset(candidates), ranges)
    except Refused as exc:
        if len(candidates) == 1:
            left_out[candidates[0]] = str(exc)
        else:
            for symbol in candidates:
                padded = (chosen[0] if chosen is not None else frozenset()) | {symbol}
                try:
                    chosen = (padded,) + _analyse(gm, example_inputs, fake_mode, env, padded,
                                                  ranges)
                except Refused as single:
                    left_out[symbol] = str(single)
    if chosen is None:
        raise Refused("; ".join(f"{_name(names, where, s)}: {why}" for s, why in left_out.items()))
    padded, inputs, outputs, ceiling = chosen
    guards = tuple(expr for expr in _shape_guards(env) if expr.free_symbols & padded)
    if any(not (expr.free_symbols <= set(where)) for expr in guards):
        raise Refused("a shape guard names a size the inputs do not give")
    return BucketPlan(padded, inputs, outputs, where, ranges, ceiling, guards, names,
                      tuple(left_out.items()))


def _name(names: tuple, where: dict, symbol: Any) -> str:
    i, dim = where[symbol]
    return f"{names[i]}" + (f".size({dim})" if dim is not None else "")


def _shape_guards(env: Any) -> list:
    exprs = [g.expr for g in env.guards]
    exprs += [sympy.Eq(s, r) for s, r in env.replacements.items()]
    return [env.replace(e) if hasattr(env, "replace") else e for e in exprs]


def _analyse(gm: Any, example_inputs: list, fake_mode: Any, env: Any, padded: frozenset,
             ranges: dict) -> tuple:
    mode = Padding(padded, ranges)
    inputs = []
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.Tensor):
            dims = tuple((d, s) for d, s in enumerate(mode.dims(value)) if s is not None)
            if any(s is MIXED for _, s in dims):
                raise Refused(f"input {i}'s size depends on a padded size other than as "
                              "itself")
            inputs.append(dims)
            mode.origin[id(value)] = "input"
        elif sym_expr(value) is not None and sym_expr(value) in padded:
            inputs.append(sym_expr(value))
        else:
            if free_symbols(value) & padded:
                raise Refused(f"input {i} depends on a padded size other than as itself")
            inputs.append(None)
    versions = [v._version if isinstance(v, torch.Tensor) else None for v in example_inputs]
    saved = _ShapeEnvState(env)
    try:
        with fake_mode, mode, torch.no_grad():
            result = gm(*example_inputs)
    finally:
        specialised = saved.restore()
    if specialised:
        # An operation the capture ran for real decides on sizes when run on fakes:
        # this run is not the graph a call runs, so it proves nothing.
        raise Refused("running the graph on fake inputs fixes sizes the capture left "
                      f"symbolic ({specialised})")
    for i, (value, version) in enumerate(zip(example_inputs, versions)):
        if version is not None and value._version != version:
            raise Refused(f"the graph writes its input {i} in place")
    leaves = result if isinstance(result, (tuple, list)) else (result,)
    outputs = []
    for j, out in enumerate(leaves):
        if isinstance(out, torch.Tensor):
            if id(out) in mode.taint:
                raise Refused(f"output {j}: {mode.taint[id(out)]}")
            dims = mode.dims(out)
            if MIXED in dims:
                raise Refused(f"output {j}'s size depends on a padded size other than as "
                              "itself")
            outputs.append(tuple((d, s) for d, s in enumerate(dims) if s is not None))
        else:
            if free_symbols(out) & padded:
                raise Refused(f"output {j} is a number computed from a padded size")
            outputs.append(())
    if not any(outputs) and not any(isinstance(x, tuple) and x for x in inputs):
        raise Refused("nothing padded reaches the graph")
    return tuple(inputs), tuple(outputs), dict(mode.ceiling)


class _ShapeEnvState:
    """What running the graph may add to the capture's ShapeEnv (guards, sizes fixed
    or bounded), saved, and put back after it: the entry's ShapeEnv stays as its
    capture left it."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.guards = len(env.guards)
        self.replacements = dict(env.replacements)
        self.ranges = dict(env.var_to_range)
        self.divisible = set(env.divisible)
        self.asserts = {k: list(v) for k, v in env.deferred_runtime_asserts.items()}

    def restore(self) -> str:
        """Puts the state back; what had changed, in words ("" when nothing)."""
        env = self.env
        changed = [f"{s} == {r}" for s, r in env.replacements.items()
                   if self.replacements.get(s) != r]
        changed += [str(g.expr) for g in env.guards[self.guards:]]
        if not changed and env.var_to_range == self.ranges and env.divisible == self.divisible \
                and {k: list(v) for k, v in env.deferred_runtime_asserts.items()} == self.asserts:
            return ""
        del env.guards[self.guards:]
        env.replacements.clear()
        env.replacements.update(self.replacements)
        env.var_to_range.clear()
        env.var_to_range.update(self.ranges)
        env.divisible.clear()
        env.divisible.update(self.divisible)
        env.deferred_runtime_asserts.clear()
        env.deferred_runtime_asserts.update(self.asserts)
        env._prev_cache_key = None   # every cached answer of the ShapeEnv asked again
        env._update_version_counter()
        return ", ".join(changed[:3]) or "a size's range"

