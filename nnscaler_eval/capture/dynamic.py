"""Symbolic sizes and int arguments: one capture for every value its guards allow.

A dynamic capture runs the forward once on *fake* inputs whose chosen dimensions (and
chosen int arguments) are symbols of a `ShapeEnv`, instead of once for real:

- what the forward computes from a symbolic size (`L * 2`, `x.view(B, L, -1)`,
  `arange(L)`, `x[:, :L]`) reaches a torch call as a `SymInt`; the tracer writes it
  into the graph as an expression of the inputs' sizes (`graph_value`: `x.size(1)`
  nodes and `operator` nodes), so every hit computes it from the actual inputs;
- every Python decision on a symbol (`if L > 512`, `min(L, k)`, `L % 8`) and every
  decision torch's own shape logic takes records a guard in the ShapeEnv; a use that
  needs a concrete value (`int(L)`, `range(L)`, indexing, `str(L)`, a dict key, a C
  extension reading it through `__index__`) specialises the symbol to its value,
  which is a guard too (`specialising_text()` makes text and hashing take that path:
  SymInt is not an int subclass, so no C code reads it without a dunder);
- sizes 0 and 1 are never symbols (torch's convention: broadcasting and empty
  tensors behave differently), except a KV cache's length of 1 (a symbol from 1 up,
  guarded wherever torch decides on it), and every symbol's range is checked: a
  symbol made from an 8 holds for 2 and above only;
- equal sizes are not assumed equal (no duck shaping): an op that needs them equal
  records `Eq(s0, s1)`;
- a tensor with a symbolic dimension is made with its strides as expressions of its
  sizes, in its own dimension order (contiguous, channels_last, a transpose), and
  each stride is checked against that expression; a tensor that is not dense stays
  static.

The entry then matches any call key that equals its own outside the symbolic fields
(the sizes, those tensors' strides, the ints) and on which the guard program holds:
`guard_program()` compiles ranges, replacements, the ShapeEnv's guards and the stride
checks into the stack code of guards/shape_guards.h, checked in C on every lookup.

The capture's result is not the call's: C runs the entry's runner on the real
arguments for that (convert_frame).  Anything the capture cannot follow symbolically
(an expression of an unknown function, a symbol of no input, a data-dependent size,
an opaque module or op, a fallback) makes `Unsupported` or a fallback, and
convert_frame captures the call with static sizes as before.

When sizes become symbolic (`plan`): torch.compile's conventions.  With
`dynamic=None` a miss whose key equals an entry of the same owner except in some
tensor sizes or int values makes those symbolic, and they stay symbolic for that
owner's later captures; `dynamic=True` makes every dimension of the tensor arguments
and every int argument symbolic from the first capture; `mark_dynamic` /
`mark_static` (ours or `torch._dynamo`'s: the same attributes) mark single
dimensions.  Only top-level arguments are made symbolic: plain tensors (not
parameters, not subclasses), ints, and floats (graph inputs for arithmetic only: a
Python decision on a float is a float guard, which the int program cannot check, so
such a forward stays static), and the tensors, ints and floats inside a KV cache passed
in (`call_key_nested_layout` gives their key offsets and attribute paths; the fake
arguments are copies of the cache, `passed_objects.copy_with`); tensors nested in
other containers stay static.  A call that passes a KV cache has every such field
symbolic from its first capture: a decoder's lengths vary by design.

Backends: the eager runner reads sizes on every call; a torch.compile backend gets
the graph with these fake inputs (their ShapeEnv), compiles it once, and the guards it
adds while compiling are in the program, which is built after it.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import operator
import struct
import weakref
from typing import Any, Iterator, Optional

import sympy
import torch
import torch.utils._pytree as pytree
from torch._guards import GuardSource, Source
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._sympy import functions as torch_sympy
from torch.utils._sympy.numbers import int_oo

from nnscaler_eval import _C
from nnscaler_eval.capture import fake_runs, passed_objects
from nnscaler_eval.config import CompileConfig
from nnscaler_eval.guarding import keyed_objects
from nnscaler_eval.tracing.locations import user_location

# A field of the call key that can be symbolic: (argument index, dimension), or
# (argument index, None) for an int argument.
Field = tuple[int, Optional[int]]


class Unsupported(Exception):
    """The capture used a symbol in a way this module cannot write into the graph or
    check in C: convert_frame captures the call with static sizes instead."""


def mark_dynamic(tensor: torch.Tensor, dim: Any) -> None:
    """Make `tensor`'s dimension `dim` (an int or a sequence of ints) symbolic from
    the first capture that takes it as an argument.  The mark is torch's own
    (`torch._dynamo.mark_dynamic` sets the same attribute), so both honour it."""
    dims = _dims_of(tensor, dim, "mark_dynamic")
    marked = set(getattr(tensor, "_dynamo_dynamic_indices", set()))
    tensor._dynamo_dynamic_indices = marked | dims  # type: ignore[attr-defined]
    static = getattr(tensor, "_dynamo_static_indices", None)
    if static:
        tensor._dynamo_static_indices = set(static) - dims  # type: ignore[attr-defined]


def mark_static(tensor: torch.Tensor, dim: Any = None) -> None:
    """Keep `tensor`'s dimension `dim` (all of them when None) specialised, whatever
    the `dynamic` setting and whatever sizes earlier calls had."""
    dims = (set(range(tensor.dim())) if dim is None
            else _dims_of(tensor, dim, "mark_static"))
    static = set(getattr(tensor, "_dynamo_static_indices", set()))
    tensor._dynamo_static_indices = static | dims  # type: ignore[attr-defined]
    marked = getattr(tensor, "_dynamo_dynamic_indices", None)
    if marked:
        tensor._dynamo_dynamic_indices = set(marked) - dims  # type: ignore[attr-defined]


def _dims_of(tensor: Any, dim: Any, what: str) -> set[int]:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"nnscaler.{what}(): expected a tensor, got {type(tensor).__name__}")
    dims = [dim] if isinstance(dim, int) else list(dim)
    out = set()
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"nnscaler.{what}(): a dimension must be an int, not {d!r}")
        if not -tensor.dim() <= d < max(tensor.dim(), 1):
            raise IndexError(f"nnscaler.{what}(): dimension {d} is out of range for a "
                             f"tensor of {tensor.dim()} dimensions")
        out.add(d % tensor.dim() if tensor.dim() else d)
    return out


# torch's functions on symbolic numbers (they dispatch to a torch function mode).
SYMBOLIC_MATH = frozenset(getattr(torch, name) for name in dir(torch)
                          if name.startswith("sym_") and callable(getattr(torch, name)))

# Torch calls whose first argument (after `self` for the method) is tensor *data*.
DATA_CONSTRUCTORS = frozenset({torch.tensor, torch.as_tensor, torch.scalar_tensor,
                               torch.Tensor.new_tensor})


def with_hints(value: Any) -> Any:
    """`value` with every symbolic int, float and bool replaced by the value it had in
    this run, without a guard (only for data a fake tensor does not hold)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.hint
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        items = [with_hints(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def refusal(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
            error: BaseException) -> str:
    """Why an op failed on a dynamic capture's fakes: the op, its first argument that
    holds a symbol (or a tensor with a symbolic size), and torch's first line."""
    where = ""
    named = [(f"argument {i}", a) for i, a in enumerate(args)]
    named += [(f"argument {k!r}", v) for k, v in kwargs.items()]
    for label, value in named:
        leaves = pytree.tree_leaves(value)
        if any(_symbolic(leaf) for leaf in leaves):
            shown = (f"a tensor of shape ({', '.join(_shown(d) for d in value.shape)})"
                     if isinstance(value, torch.Tensor) else _shown(value))
            where = f" ({label}: {shown})"
            break
    message = (str(error).strip().splitlines() or [""])[0]
    return f"{name} refused symbolic sizes{where}: {type(error).__name__}: {message}"


def _shown(value: Any) -> str:
    """`value` as text, symbols by their expressions (str() of a symbol during a
    capture would specialise it)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(value.node.expr)
    if isinstance(value, (tuple, list)):
        items = ", ".join(_shown(v) for v in value)
        return f"[{items}]" if isinstance(value, list) else f"({items})"
    return repr(value)


def _symbolic(value: Any) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return not value.node.expr.is_number
    if isinstance(value, torch.Tensor):
        return any(isinstance(d, torch.SymInt) for d in value.shape)
    return False


# --------------------------------------------------------------------------- the plan

# bucket -> the fields that became symbolic for it (automatic dynamic remembers them
# for the owner's later captures, as torch.compile does per frame).
_symbolic_fields: "weakref.WeakKeyDictionary[Any, set[Field]]" = weakref.WeakKeyDictionary()
# buckets whose dynamic capture failed (Unsupported, a fallback): captured statically
# from then on, so a forward that cannot be captured symbolically is tried once.
_failed: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _i64(data: bytes, offset: int) -> int:
    return struct.unpack_from("q", data, offset)[0]


def _step(step: tuple) -> Any:
    kind, value = step
    return (pytree.GetAttrKey(value) if kind == "a" else pytree.MappingKey(value)
            if kind == "k" else pytree.SequenceKey(value))


def _key_text(key: Any) -> str:
    """A pytree key as it reads in source: `.keys`, `[0]`, `['k']`."""
    if isinstance(key, pytree.GetAttrKey):
        return f".{key.name}"
    if isinstance(key, pytree.SequenceKey):
        return f"[{key.idx}]"
    return f"[{key.key!r}]"


def field_table(call_key: Any, values: tuple) -> Optional[list[tuple[tuple, Any, tuple]]]:
    """The key's fields with the values they describe: one (layout item, value,
    (argument index, pytree keys)) per argument, then one per tensor, int and float
    inside a KV cache passed in (call_key_nested_layout); a Field's index is a
    position in this list.  None when the key does not describe `values`."""
    layout = _C.call_key_layout(call_key)
    if len(layout) != len(values):
        return None
    table = [(item, value, (index, ())) for index, (item, value) in enumerate(zip(layout, values))]
    for item in _C.call_key_nested_layout(call_key):
        index, *steps = item[-1]
        keys = tuple(_step(step) for step in steps)
        try:
            value = passed_objects.resolve(values[index], keys)
        except (KeyError, IndexError, TypeError, AttributeError):
            return None   # the arguments changed since the key was built
        table.append((item[:-1], value, (index, keys)))
    return table


def _symbolic_candidates(table: list) -> dict[Field, int]:
    """Every field that may be made symbolic, with its key offset."""
    fields: dict[Field, int] = {}
    for index, (item, value, _) in enumerate(table):
        if item[0] == "tensor" and type(value) is torch.Tensor:
            _, offset, ndim = item
            for d in range(ndim):
                fields[(index, d)] = offset + 8 * d
        elif item[0] in ("int", "float") and type(value) is (int if item[0] == "int" else float):
            fields[(index, None)] = item[1]
    return fields


def _differing(table: list, data: bytes, other_table: list, other: bytes) -> Optional[set[Field]]:
    """The fields in which two keys differ, when they differ only in sizes (with the
    strides of tensors whose sizes differ) and int values; else None."""
    if len(data) != len(other) or [t[0] for t in table] != [t[0] for t in other_table]:
        return None
    ignored: set[int] = set()   # offsets of 8-byte fields compared below, not as bytes
    diff: set[Field] = set()
    for index, (item, value, _) in enumerate(table):
        if item[0] == "tensor" and type(value) is torch.Tensor:
            _, offset, ndim = item
            sizes = [d for d in range(ndim)
                     if _i64(data, offset + 8 * d) != _i64(other, offset + 8 * d)]
            ignored.update(offset + 8 * d for d in range(ndim))
            if sizes:
                diff.update((index, d) for d in sizes)
                ignored.update(offset + 8 * (ndim + d) for d in range(ndim))
        elif item[0] in ("int", "float") and type(value) in (int, float):
            if _i64(data, item[1]) != _i64(other, item[1]):
                diff.add((index, None))
            ignored.add(item[1])
    at = 0
    for offset in sorted(ignored):
        if data[at:offset] != other[at:offset]:
            return None
        at = offset + 8
    if data[at:] != other[at:]:
        return None
    return diff


def _marked(table: list) -> tuple[set[Field], set[Field]]:
    dynamic: set[Field] = set()
    static: set[Field] = set()
    for index, (_, value, _) in enumerate(table):
        if isinstance(value, torch.Tensor):
            dynamic.update((index, d) for d in getattr(value, "_dynamo_dynamic_indices", ()))
            static.update((index, d) for d in getattr(value, "_dynamo_static_indices", ()))
    return dynamic, static


def candidates(call_key: Any, values: tuple) -> dict[Field, int]:
    """The fields of a key that may be made symbolic, with their key offsets."""
    table = field_table(call_key, values)
    return _symbolic_candidates(table) if table is not None else {}


def marked_dims(values: tuple) -> set[Field]:
    """The top-level tensor arguments' dimensions marked dynamic (mark_dynamic)."""
    return _marked([(None, value, None) for value in values])[0]


def plan(config: CompileConfig, bucket: Any, call_key: Any, values: tuple) -> Optional[frozenset]:
    """The fields to make symbolic in this miss's capture, or None (a static one)."""
    if config.dynamic is False or bucket in _failed:
        return None
    table = field_table(call_key, values)
    if table is None:
        return None
    candidates = _symbolic_candidates(table)
    if not candidates:
        return None
    marked, static = _marked(table)
    wanted = set(marked)
    if config.dynamic or (config.dynamic is None and passes_kv_cache(values)):
        # A decoder step with a KV cache: its lengths (the prompt's, the cache's) vary
        # by design, so its sizes are symbolic from the first capture, as with
        # dynamic=True (a first static capture would serve one length only).
        wanted |= set(candidates)
    else:
        data = _C.call_key_bytes(call_key)
        for entry in bucket.entries:
            info = getattr(entry, "info", None)
            if info is None or entry.runner is None or not getattr(info, "symbolic_ok", False):
                continue
            other = _stored_table(entry, table)
            diff = (_differing(table, data, other, _C.call_key_bytes(entry))
                    if other is not None else None)
            if diff:
                wanted |= diff
        remembered = _symbolic_fields.get(bucket)
        if remembered and wanted:
            wanted |= remembered
        elif remembered:
            # Sizes that changed before: symbolic again, but only when this key could
            # not have been served by an earlier entry (it is a miss) and has the
            # fields at all.
            wanted = set(remembered)
    wanted = {f for f in wanted if f in candidates and f not in static}
    if not wanted:
        return None
    if not config.dynamic:
        _symbolic_fields.setdefault(bucket, set()).update(wanted)
    return frozenset(wanted)


def passes_kv_cache(values: tuple) -> bool:
    """Does the call pass a KV cache (whose sizes are symbolic from the first capture)?"""
    return any(keyed_objects.holds_kv_cache(value) for value in values)


def _stored_table(entry: Any, table: list) -> Optional[list]:
    """A stored entry's fields (its layouts), with this call's values: the layouts
    must be equal for the keys to differ in fields only."""
    layout = _C.call_key_layout(entry)
    nested = _C.call_key_nested_layout(entry)
    items = list(layout) + [item[:-1] for item in nested]
    if len(items) != len(table):
        return None
    return [(item, value, where) for item, (_, value, where) in zip(items, table)]


def failed(bucket: Any) -> None:
    """Capture `bucket`'s calls statically from now on."""
    _failed.add(bucket)


# ------------------------------------------------------------------- fake inputs


@dataclasses.dataclass(frozen=True)
class ArgumentSource(Source):
    """Where a symbol comes from, for ShapeEnv's messages: `x.size(1)`, `n`."""

    label: str

    @property
    def _name_template(self) -> str:
        return self.label

    @property
    def guard_source(self) -> GuardSource:  # type: ignore[override]
        return GuardSource.LOCAL


class SymbolicInputs:
    """The fake arguments of one dynamic capture and what its entry checks."""

    def __init__(self, fields: frozenset, call_key: Any, values: tuple,
                 names: tuple[str, ...]) -> None:
        self.shape_env = ShapeEnv(duck_shape=False, specialize_zero_one=True)
        # static_shapes: a real tensor met in the trace (a parameter) becomes a fake
        # of its own sizes; only the arguments made here have symbols.
        self.fake_mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True,
                                        static_shapes=True)
        self.key_len = len(_C.call_key_bytes(call_key))
        self.bindings: dict[sympy.Symbol, int] = {}     # int symbol -> key offset
        self.float_symbols: set[sympy.Symbol] = set()   # float arguments' symbols
        self.uses: list[tuple[Any, tuple[str, int]]] = []   # values read: (symbols, line)
        self.origins: dict[sympy.Symbol, str] = {}      # symbol -> "x.size(1)", "n"
        self.wild: set[int] = set()
        self.stride_checks: list[tuple[int, Any]] = []  # (key offset, expression)
        # Symbolic int and float inputs: (argument index, pytree keys, symbol).
        self.scalar_inputs: list[tuple[int, tuple, sympy.Symbol]] = []
        self.sources: dict[sympy.Symbol, tuple[int, Optional[int]]] = {}
        self.symbol_nodes: dict[sympy.Symbol, Any] = {}
        self._emitted: dict[tuple[int, Any], Any] = {}
        table = field_table(call_key, values)
        if table is None:
            raise Unsupported("the arguments changed since their key was built")
        self.field_values: list[Any] = [value for _, value, _ in table]
        replaced: dict[tuple[int, tuple], Any] = {}
        for index, (item, value, (top, keys)) in enumerate(table):
            dims = {d for (i, d) in fields if i == index}
            if not dims:
                continue
            name = names[top] + "".join(_key_text(k) for k in keys)
            if None in dims and type(value) is float:
                fake = self._float(index, value, item[1], name)
            elif None in dims:
                fake = self._int(index, value, item[1], name)
            else:
                fake = self._tensor(index, value, dims, item[1], name,
                                    in_cache=bool(keys) and
                                    keyed_objects.holds_kv_cache(values[top]))
            self.field_values[index] = fake
            if isinstance(fake, (torch.SymInt, torch.SymFloat)):
                self.scalar_inputs.append((top, keys, fake.node.expr))
            replaced[(top, keys)] = fake
        # A tensor passed twice (`model(input_ids=ids, labels=ids)`: the key says the
        # second is an alias of the first) is the same fake in both places.
        fakes = {id(table[i][1]): fake for i, fake in enumerate(self.field_values)
                 if fake is not table[i][1] and isinstance(fake, torch.Tensor)}

        def leaf_of(index: int, keys: tuple, leaf: Any) -> Any:
            found = replaced.get((index, keys))
            if found is None and isinstance(leaf, torch.Tensor):
                found = fakes.get(id(leaf))
            return leaf if found is None else found

        # Arguments holding KV caches are copied (passed_objects.copy_with) whether or
        # not a field of theirs is symbolic: the forward writes into the copy.
        memo: dict[int, Any] = {}   # one cache in two arguments: one copy
        self.values = tuple(
            passed_objects.copy_with(value, lambda keys, leaf, _i=index: leaf_of(_i, keys, leaf),
                                     (), memo)
            if passed_objects.holds_keyed(value) else leaf_of(index, (), value)
            for index, value in enumerate(values))

    def _int(self, index: int, value: int, offset: int, name: str) -> Any:
        symbol = self.shape_env.create_symbol(value, ArgumentSource(name),
                                              dynamic_dim=DimDynamic.DYNAMIC)
        if not isinstance(symbol, sympy.Symbol):
            return value   # 0 or 1: specialised
        self.bindings[symbol] = offset
        self.origins[symbol] = name
        self.wild.add(offset)
        self.sources[symbol] = (index, None)
        return self.shape_env.create_symintnode(symbol, hint=value)

    def _float(self, index: int, value: float, offset: int, name: str) -> Any:
        """A float argument: a graph input that arithmetic may use; any Python
        decision on it, or a use needing its value, is not compiled (Unsupported:
        the guard program works on ints), so such a forward is captured statically."""
        symbol = self.shape_env.create_unspecified_symbol(value, ArgumentSource(name),
                                                          dynamic_dim=DimDynamic.DYNAMIC)
        self.float_symbols.add(symbol)
        self.origins[symbol] = name
        self.wild.add(offset)
        self.sources[symbol] = (index, None)
        return self.shape_env.create_symfloatnode(symbol, hint=value)

    def _tensor(self, index: int, tensor: torch.Tensor, dims: set[int], offset: int,
                name: str, in_cache: bool = False) -> Any:
        """A fake of `tensor` whose `dims` are symbols.  A length of 1 in a KV cache
        (a decoder's second step) is a symbol too, ranging over 1 and above: the cache
        grows by design, and a capture that specialised it would be followed by another
        at length 2.  torch guards every decision it takes on that symbol (broadcasting
        a 1 specialises it), as with Dynamo's backed_size_oblivious; 0 stays
        specialised (empty tensors take other paths)."""
        sizes, strides = list(tensor.shape), list(tensor.stride())
        ndim = len(sizes)
        order = _dense_order(sizes, strides)
        if order is None:
            return tensor   # overlapping or with gaps: static
        sym_sizes: list[Any] = []
        for d, size in enumerate(sizes):
            if d in dims:
                one = in_cache and size == 1
                symbol = self.shape_env.create_symbol(
                    size, ArgumentSource(f"{name}.size({d})"), dynamic_dim=DimDynamic.DYNAMIC,
                    do_not_specialize_zero_one=one)
                if one and isinstance(symbol, sympy.Symbol):
                    self.shape_env.constrain_symbol_range(symbol, compiler_min=1,
                                                          compiler_max=int_oo)
                if isinstance(symbol, sympy.Symbol):
                    self.bindings[symbol] = offset + 8 * d
                    self.origins[symbol] = f"{name}.size({d})"
                    self.sources[symbol] = (index, d)
                    self.wild.add(offset + 8 * d)
                    sym_sizes.append(self.shape_env.create_symintnode(symbol, hint=size))
                    continue
            sym_sizes.append(size)
        if not any(isinstance(s, torch.SymInt) for s in sym_sizes):
            return tensor
        sym_strides: list[Any] = [0] * ndim
        expected: Any = 1
        for d in order:
            sym_strides[d] = expected
            expected = expected * sym_sizes[d]
        for d in range(ndim):
            stride = sym_strides[d]
            if isinstance(stride, torch.SymInt):
                self.wild.add(offset + 8 * (ndim + d))
                self.stride_checks.append((offset + 8 * (ndim + d), stride.node.expr))
            # else a constant (the innermost 1): compared with the key's bytes
        with self.fake_mode:
            fake = torch.empty_strided(sym_sizes, sym_strides, dtype=tensor.dtype,
                                       device=tensor.device)
        if tensor.requires_grad:
            fake.requires_grad_(True)
        return fake

    # -- during the trace ---------------------------------------------------------

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The fake mode, and text and hashing of symbols specialising them.

        With the Python dispatcher, as torch.compile traces: the meta functions torch
        registers in Python take sizes as symbols where the C++ kernels of a few ops
        need concrete ones (`constant_pad_nd` under `F.pad`, `upsample_bilinear2d`
        under `F.interpolate`: "SymIntArrayRef expected to contain only concrete
        integers")."""
        with self.fake_mode, enable_python_dispatcher(), specialising_text(self.uses), \
                fake_runs.quiet():
            yield

    def graph_value(self, tracer: Any, value: Any) -> Any:
        """A SymInt / SymFloat / SymBool as an fx argument: its expression over the
        inputs' sizes, as nodes of the graph being recorded (or a constant)."""
        expr = self.shape_env.replace(value.node.expr)
        if expr.is_number:
            return _number(expr)
        return self._emit(tracer, expr)

    def _emit(self, tracer: Any, expr: Any) -> Any:
        if expr.is_number:
            return _number(expr)
        memo = (id(tracer.graph), expr)
        node = self._emitted.get(memo)
        if node is not None:
            return node
        if isinstance(expr, sympy.Symbol):
            node = tracer.symbol_node(self, expr)
        else:
            function, operands = _operation(expr)
            args = [self._emit(tracer, a) for a in operands]
            node = args[0]
            if function is None:
                pass
            elif len(args) == 1:
                node = tracer.create_node("call_function", function, (node,), {})
            else:
                for arg in args[1:]:
                    node = tracer.create_node("call_function", function, (node, arg), {})
        self._emitted[memo] = node
        return node

    def hint(self, symbol: sympy.Symbol) -> int:
        values = getattr(self.shape_env, "backed_var_to_val", None)
        if values is None:
            values = self.shape_env.var_to_val
        return int(values[symbol])

    # -- after the trace ------------------------------------------------------------

    def guard_program(self) -> tuple[tuple[int, ...], tuple[int, ...], list[str]]:
        """(wild offsets, program, the guards in words) for the entry."""
        env = self.shape_env
        if env.deferred_runtime_asserts and any(env.deferred_runtime_asserts.values()):
            raise Unsupported("the capture made runtime assertions on data-dependent sizes")
        code: list[int] = []
        words: list[str] = []
        for symbol in self.float_symbols:
            if symbol in env.replacements or any(symbol in g.expr.free_symbols
                                                 for g in env.guards):
                raise Unsupported(f"Python used the float argument {self.origins[symbol]} "
                                  "as a value (a decision, math, int())")
        for symbol, offset in self.bindings.items():
            bounds = env.var_to_range.get(symbol)
            target = env.replacements.get(symbol)
            if isinstance(target, sympy.Symbol) and target in self.bindings and \
                    _within(env.var_to_range.get(target), bounds):
                continue   # equal to a symbol whose checked range lies inside its own
            name = self.origins[symbol]
            if bounds is not None:
                lower, upper = bounds.lower, bounds.upper
                # torch's int_oo says it is finite: ask for an Integer instead
                if getattr(lower, "is_Integer", False):
                    code += [_C.SG_CHECK_GE_CONST, offset, int(lower)]
                    words.append(f"{name} >= {int(lower)}")
                if getattr(upper, "is_Integer", False) and int(upper) < 2 ** 62:
                    code += [_C.SG_CHECK_LE_CONST, offset, int(upper)]
                    words.append(f"{name} <= {int(upper)}")
        for symbol, replacement in env.replacements.items():
            if symbol in self.bindings:
                self._equal(self.bindings[symbol], replacement, code)
                words.append(f"{self._text(symbol)} == {self._text(replacement)}")
        # an equality already checked as a replacement is not checked twice
        seen = {sympy.Eq(s, r) for s, r in env.replacements.items() if s in self.bindings}
        seen |= {sympy.Eq(r, s) for s, r in env.replacements.items() if s in self.bindings}
        for guard in env.guards:
            if guard.expr in seen:
                continue
            seen.add(guard.expr)
            self._check(guard.expr, code)
            words.append(self._text(guard.expr))
        for offset, expr in self.stride_checks:
            self._equal(offset, expr, code)
        return tuple(sorted(self.wild)), tuple(code), words

    def _equal(self, offset: int, expr: Any, code: list[int]) -> None:
        """The field at `offset` equals `expr`: a fused check where it is a constant
        or another field."""
        expr = sympy.sympify(expr)
        if expr.is_Integer:
            code += [_C.SG_CHECK_EQ_CONST, offset, int(expr)]
        elif isinstance(expr, sympy.Symbol) and expr in self.bindings:
            code += [_C.SG_CHECK_EQ_LOAD, offset, self.bindings[expr]]
        else:
            code += [_C.SG_LOAD, offset]
            self._compile(expr, code)
            code += [_C.SG_EQ, _C.SG_CHECK]

    def _check(self, expr: Any, code: list[int]) -> None:
        """`expr` holds: a fused check for `symbol <relation> constant` and
        `symbol == symbol`, else the expression and CHECK."""
        lhs, rhs = (expr.args if isinstance(expr, sympy.core.relational.Relational)
                    else (None, None))
        if isinstance(lhs, sympy.Symbol) and lhs in self.bindings:
            offset = self.bindings[lhs]
            if isinstance(expr, sympy.Eq):
                self._equal(offset, rhs, code)
                return
            if rhs.is_Integer:
                bound = int(rhs)
                fused = {sympy.Ge: (_C.SG_CHECK_GE_CONST, bound),
                         sympy.Gt: (_C.SG_CHECK_GE_CONST, bound + 1),
                         sympy.Le: (_C.SG_CHECK_LE_CONST, bound),
                         sympy.Lt: (_C.SG_CHECK_LE_CONST, bound - 1)}.get(type(expr))
                if fused is not None:
                    code += [fused[0], offset, fused[1]]
                    return
        self._compile(expr, code)
        code.append(_C.SG_CHECK)

    def specialised(self) -> list[str]:
        """The symbols the capture fixed to one value (`int(L)`, `range(L)`), in
        words with where torch recorded it; all of them: the capture is static."""
        out = []
        for symbol in self.bindings:
            value = self.shape_env.replacements.get(symbol)
            if value is not None and value.is_number:
                out.append(f"{self.origins[symbol]} == {value}{self._where(symbol)}")
        return out

    def _where(self, symbol: Any) -> str:
        for symbols, (filename, lineno) in self.uses:
            if symbol in symbols:
                return f" (its value read at {filename}:{lineno})"
        return ""

    def _text(self, expr: Any) -> str:
        return str(expr.xreplace({s: sympy.Symbol(self.origins[s]) for s in self.bindings}))

    def symbols_in_words(self) -> list[str]:
        """`x.size(1) in [2, oo)` per symbol, for explain()."""
        out = []
        for symbol in self.bindings:
            bounds = self.shape_env.var_to_range.get(symbol)
            value = self.shape_env.replacements.get(symbol)
            where = (f"specialised to {self._text(value)}" if value is not None
                     else f"in [{bounds.lower}, {bounds.upper}]" if bounds is not None else "")
            out.append(f"{self.origins[symbol]} ({symbol}) {where}".rstrip())
        return out

    def _compile(self, expr: Any, code: list[int]) -> None:
        expr = sympy.sympify(expr)
        if expr is sympy.true:
            code += [_C.SG_CONST, 1]
            return
        if expr is sympy.false:
            code += [_C.SG_CONST, 0]
            return
        if expr.is_number:
            number = _number(expr)
            if not isinstance(number, (int, bool)):
                raise Unsupported(f"a non-integer constant {expr} in a size guard")
            code += [_C.SG_CONST, int(number)]
            return
        if isinstance(expr, sympy.Symbol):
            offset = self.bindings.get(expr)
            if offset is None:
                raise Unsupported(f"symbol {expr} is not a size or int of an argument")
            code += [_C.SG_LOAD, offset]
            return
        function, operands = _operation(expr)
        if function is None:
            self._compile(operands[0], code)
            return
        opcode = _OPCODES.get(function)
        if opcode is None:
            raise Unsupported(f"a guard on {expr} is not integer arithmetic")
        self._compile(operands[0], code)
        if function in (operator.neg, operator.not_):
            code.append(opcode)
            return
        for operand in operands[1:]:
            self._compile(operand, code)
            code.append(opcode)


def _within(inner: Any, outer: Any) -> bool:
    """The value range `inner` lies inside `outer` (both ValueRanges, or None)."""
    if inner is None or outer is None:
        return outer is None
    return bool(outer.lower <= inner.lower) and bool(inner.upper <= outer.upper)


def _dense_order(sizes: list[int], strides: list[int]) -> Optional[list[int]]:
    """The dimensions from innermost to outermost when the tensor is dense and
    non-overlapping (a permutation of a contiguous layout), else None."""
    order = sorted(range(len(sizes)), key=lambda d: (strides[d], -d))
    expected = 1
    for d in order:
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return order


def _number(expr: Any) -> Any:
    if expr is sympy.true or expr is sympy.false:
        return bool(expr)
    if expr.is_Integer:
        return int(expr)
    if expr.is_Float or expr.is_Rational:
        return float(expr)
    raise Unsupported(f"constant {expr}")


# sympy head -> the Python function a graph node calls (and the guard opcode)
def _operation(expr: Any) -> tuple[Any, tuple]:
    if isinstance(expr, sympy.Add):
        return operator.add, expr.args
    if isinstance(expr, sympy.Mul):
        if any(a.is_Rational and not a.is_Integer for a in expr.args):
            raise Unsupported(f"a fraction in {expr}")
        return operator.mul, expr.args
    if isinstance(expr, sympy.Pow):
        base, exponent = expr.args
        if not (exponent.is_Integer and int(exponent) >= 0):
            raise Unsupported(f"a power that is not a natural number in {expr}")
        return operator.pow, expr.args
    for kinds, function in _TORCH_FUNCTIONS:
        if isinstance(expr, kinds):
            return function, expr.args
    for kind, function in _RELATIONS:
        if isinstance(expr, kind):
            return function, expr.args
    if isinstance(expr, sympy.Not):
        return operator.not_, expr.args
    if isinstance(expr, sympy.And):
        return operator.and_, expr.args
    if isinstance(expr, sympy.Or):
        return operator.or_, expr.args
    raise Unsupported(f"cannot write {type(expr).__name__} ({expr}) into the graph")


def _kinds(*names: str) -> tuple[type, ...]:
    """torch's sympy functions by name (those this torch has)."""
    return tuple(getattr(torch_sympy, n) for n in names if hasattr(torch_sympy, n))


_TORCH_FUNCTIONS = (
    (_kinds("FloorDiv", "CleanDiv"), operator.floordiv),
    (_kinds("Mod", "PythonMod") + (sympy.Mod,), operator.mod),
    (_kinds("Max") + (sympy.Max,), builtins.max),
    (_kinds("Min") + (sympy.Min,), builtins.min),
    (_kinds("PowByNatural", "FloatPow"), operator.pow),
    (_kinds("FloatTrueDiv", "IntTrueDiv"), operator.truediv),
    (_kinds("ToFloat"), float),
    (_kinds("TruncToInt"), int),
    (_kinds("Identity"), None),   # the value itself
)

_RELATIONS = ((sympy.Eq, operator.eq), (sympy.Ne, operator.ne), (sympy.Lt, operator.lt),
              (sympy.Le, operator.le), (sympy.Gt, operator.gt), (sympy.Ge, operator.ge))

_OPCODES = {
    operator.add: _C.SG_ADD, operator.mul: _C.SG_MUL, operator.pow: _C.SG_POW,
    operator.floordiv: _C.SG_FLOORDIV, operator.mod: _C.SG_MOD, builtins.max: _C.SG_MAX,
    builtins.min: _C.SG_MIN, operator.eq: _C.SG_EQ, operator.ne: _C.SG_NE,
    operator.lt: _C.SG_LT, operator.le: _C.SG_LE, operator.gt: _C.SG_GT,
    operator.ge: _C.SG_GE, operator.not_: _C.SG_NOT, operator.and_: _C.SG_AND,
    operator.or_: _C.SG_OR, operator.neg: _C.SG_NEG,
}


@contextlib.contextmanager
def specialising_text(uses: Optional[list] = None) -> Iterator[None]:
    """While a dynamic capture runs: `str`, `repr`, `format` and `hash` of a symbolic
    int, float or bool give its value's, specialising it (a guard), as eager's value
    would read.  Every use that needs the value (those, `int()`, `__index__`, `bool()`)
    appends (its symbols, the user's file:line) to `uses`, for the log of why a symbol
    was specialised.  Class attributes, restored on the way out (one capture at a
    time)."""
    saved = []
    for cls, plain in ((torch.SymInt, int), (torch.SymFloat, float), (torch.SymBool, bool)):
        for name in ("__str__", "__repr__", "__format__", "__hash__", "__int__",
                     "__index__", "__float__", "__bool__"):
            saved.append((cls, name, cls.__dict__.get(name, _MISSING)))
        if uses is not None:
            for name in ("__int__", "__index__", "__float__", "__bool__"):
                original = cls.__dict__.get(name)
                if original is None:
                    continue

                def noted(self: Any, _original: Any = original) -> Any:
                    with contextlib.suppress(Exception):
                        uses.append((self.node.expr.free_symbols, user_location()))
                    return _original(self)

                setattr(cls, name, noted)

        def text(self: Any, _plain: Any = plain) -> str:
            return str(_plain(self))

        def representation(self: Any, _plain: Any = plain) -> str:
            return repr(_plain(self))

        def formatted(self: Any, spec: str, _plain: Any = plain) -> str:
            return format(_plain(self), spec)

        def hashed(self: Any, _plain: Any = plain) -> int:
            return hash(_plain(self))

        cls.__str__ = text  # type: ignore[method-assign]
        cls.__repr__ = representation  # type: ignore[method-assign]
        cls.__format__ = formatted  # type: ignore[method-assign]
        cls.__hash__ = hashed  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, name, value in saved:
            if value is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(cls, name)
            else:
                setattr(cls, name, value)


_MISSING = object()
