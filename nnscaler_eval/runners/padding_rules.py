"""The padding rules of size buckets (runners/size_buckets.py): a dispatch mode that
runs a captured graph on its fake inputs and judges each ATen operation, whether the
kept positions of its results (the first n of each padded dimension, n + c of one
extended or cut at its end) are eager's for any values in the padded ones.

It follows, per tensor: its layout (the row-major factors of each dimension's size,
a padded symbol kept whole: `layout()`), a taint (why its kept positions may not be
eager's, given lazily: a taint that never reaches an output costs nothing), values
that follow positions (an `arange` of a padded size, offsets, moves, index reads)
and the causal masks compared from them, and where index tensors came from (copies
of the caller's: always valid indices).  The rules read torch's op tags and the
schema's arguments, never the module that called an operation.
"""
from __future__ import annotations

from typing import Any, Optional

import sympy
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

MIXED = object()   # a size that depends on a padded symbol other than as itself


class Refused(Exception):
    """The graph cannot be padded: the message says where and why."""


# -- which operations keep padded positions apart --------------------------------------

# Results whose values ignore their tensor operands' values (fills, `*_like`).
_FILLS = {"empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like",
          "full_like", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
          "empty_strided", "scalar_tensor"}
# Same values, dimensions moved whole or of size 1 added, dropped or expanded.
_MOVES = {"permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "detach", "alias",
          "clone", "contiguous", "_to_copy", "lift_fresh", "lift_fresh_copy", "copy",
          "copy_", "_conj", "conj", "resolve_conj", "resolve_neg", "permute_copy",
          "transpose_copy", "unsqueeze_copy", "squeeze_copy", "t_copy", "expand_copy",
          "alias_copy", "detach_copy", "tril", "triu", "masked_fill", "masked_fill_"}
# Moves that keep where a value came from (an index copied from the caller stays one).
_KEEPS_ORIGIN = _MOVES - {"tril", "triu", "masked_fill", "masked_fill_", "copy", "copy_"}
_VIEWS = {"view", "_unsafe_view", "reshape", "view_copy", "_reshape_copy", "_reshape_alias"}
# Dtypes that hold every position of any size met in practice exactly.
_EXACT = (torch.int32, torch.int64, torch.float32, torch.float64)
# Moves whose result's values are the operand's, at known places.
_POSITION_MOVES = (_KEEPS_ORIGIN - {"copy"}) | _VIEWS | {"slice", "select"}
_SPLITS = {"split", "split_with_sizes", "unbind", "chunk", "unsafe_split",
           "unsafe_split_with_sizes", "tensor_split", "unsafe_chunk", "split_copy",
           "split_with_sizes_copy", "unbind_copy"}
_CUMULATIVE = {"cumsum", "cumsum_", "cumprod", "cumprod_", "cummax", "cummin",
               "logcumsumexp", "_cummax_helper", "_cummin_helper"}
# Operations over the dimensions named by `dim` (all of them when it is None or []),
# beside those torch tags `reduction`.
_OVER_DIMS = {"_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax", "sort",
              "topk", "argsort", "kthvalue", "median", "nanmedian", "mode", "var_mean",
              "std_mean", "aminmax"}
_NORMS = {"native_layer_norm", "_fused_rms_norm", "native_group_norm",
          "_native_batch_norm_legit_no_training", "_native_batch_norm_legit",
          "native_batch_norm", "_native_batch_norm_legit_functional"}
# (operand, contracted dimension) pairs of products.
_CONTRACTIONS = {
    "mm": (("self", 1), ("mat2", 0)), "_int_mm": (("self", 1), ("mat2", 0)),
    "bmm": (("self", 2), ("mat2", 1)), "addmm": (("mat1", 1), ("mat2", 0)),
    "baddbmm": (("batch1", 2), ("batch2", 1)), "mv": (("self", 1), ("vec", 0)),
    "addmv": (("mat", 1), ("vec", 0)), "dot": (("self", 0), ("tensor", 0)),
    "vdot": (("self", 0), ("tensor", 0)),
    "addbmm": (("batch1", 0), ("batch1", 2), ("batch2", 1)),
}
# Operations independent along their first operand's dimension 0 only (a batch).
_BATCHWISE = {"convolution", "_convolution", "convolution_overrideable", "cudnn_convolution",
              "mkldnn_convolution", "_slow_conv2d_forward", "max_pool2d_with_indices",
              "max_pool3d_with_indices", "avg_pool2d", "avg_pool3d", "_adaptive_avg_pool2d",
              "_adaptive_avg_pool3d", "adaptive_max_pool2d", "upsample_nearest2d",
              "upsample_bilinear2d", "upsample_nearest1d", "upsample_linear1d",
              "_upsample_bilinear2d_aa", "_upsample_nearest_exact2d", "im2col"}
_ATTENTION = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_fused_attention_overrideable", "scaled_dot_product_attention",
              "_scaled_dot_product_attention_math"}
# Lookups by index tensors: (table operand, its indexed dimension or None for `index`,
# index operand).
_LOOKUPS = {"embedding": ("weight", 0, "indices"), "index_select": ("self", "dim", "index"),
            "gather": ("self", "dim", "index"), "index": ("self", None, "indices")}


def sym_expr(value: Any) -> Any:
    """The sympy expression of a SymInt, SymFloat or SymBool; None for anything else."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.expr
    return None


def free_symbols(value: Any) -> set:
    """The symbols a (possibly nested) non-tensor argument depends on."""
    out: set = set()
    for leaf in pytree.tree_leaves(value):
        expr = sym_expr(leaf)
        if expr is not None:
            out |= expr.free_symbols
    return out


def _is(value: Any, *constants: Any) -> bool:
    """`value` is one of `constants`, a plain Python value: a SymInt is never compared
    (its == would evaluate at the capture's example sizes)."""
    return (value is None and None in constants) or (
        type(value) in (int, float, bool) and value in constants)


def _size(size: Any) -> Any:
    expr = sym_expr(size)
    return expr if expr is not None else sympy.Integer(int(size))


def _padded_symbol(expr: Any, padded: frozenset) -> Any:
    """The padded symbol of a size `s` or `s + c` (c an integer: a padded dimension
    extended or cut at its end, whose kept positions are the first n + c), else None."""
    if expr in padded:
        return expr
    if isinstance(expr, sympy.Add) and len(expr.args) == 2:
        a, b = expr.args
        if a.is_Integer and b in padded:
            return b
        if b.is_Integer and a in padded:
            return a
    return None


def _merge_clean(factors: list, padded: frozenset) -> tuple:
    """Factors with each run of sizes that are not padded multiplied into one, and
    1s dropped."""
    out: list = []
    for factor in factors:
        if factor == 1:
            continue
        if out and not (factor.free_symbols & padded) and not (out[-1].free_symbols & padded):
            out[-1] = out[-1] * factor
        else:
            out.append(factor)
    return tuple(out)


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound: dict[str, Any] = {}
    positional = [a for a in func._schema.arguments if not a.kwarg_only]
    for spec, value in zip(positional, args):
        bound[spec.name] = value
    for spec in func._schema.arguments:
        if spec.name not in bound:
            bound[spec.name] = kwargs.get(spec.name, spec.default_value
                                          if spec.has_default_value() else None)
    return bound


def _norm_dims(dim: Any, rank: int) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(rank))
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    return [int(d) % max(rank, 1) for d in dims]


class Padding(TorchDispatchMode):
    """Follows, while the graph runs on fakes, which results' unpadded positions are
    eager's (`taint` maps the others to why) and where index tensors came from."""

    def __init__(self, padded: frozenset, ranges: dict) -> None:
        super().__init__()
        self.padded = padded
        self.ranges = ranges                  # symbol -> (lower, upper or None)
        self.taint: dict[int, str] = {}
        self.origin: dict[int, str] = {}      # id -> "input": values copied from the caller
        # id -> (dim, symbol, c): the value at each position is its index along dim,
        # a padded dimension, plus c (an arange of the padded size, moved and indexed)
        self.position: dict[int, tuple] = {}
        # id -> (q, k): a boolean tensor False wherever its index along k exceeds its
        # index along q, both padded dimensions of one size (a causal mask)
        self.causal: dict[int, tuple] = {}
        self.constant: dict[int, Any] = {}    # id -> the number a 0-d constant holds
        self.ceiling: dict[Any, int] = {}     # symbol -> largest bucket an index allows
        self.layouts: dict[int, tuple] = {}   # id -> layout() set by the op that made it
        self.keep: list = []                  # every tensor met: ids stay theirs

    def layout(self, t: torch.Tensor) -> tuple:
        """Per dimension, the factors of its size in row-major order (a padded symbol
        or a product of sizes that are not padded; () for 1), or None where it is
        not known how padded positions lie in it."""
        known = self.layouts.get(id(t))
        if known is not None and len(known) == t.dim():
            return known
        return tuple(self._derive(s) for s in t.shape)

    def _derive(self, size: Any) -> Optional[tuple]:
        expr = _size(size)
        if not (expr.free_symbols & self.padded):
            return _merge_clean([expr], self.padded)
        return (expr,) if _padded_symbol(expr, self.padded) is not None else None

    def dims(self, t: torch.Tensor) -> tuple:
        """Per dimension: None where no position is padded, the symbol where the
        dimension is one padded size, else MIXED (padded sizes merged with others)."""
        out = []
        for factors in self.layout(t):
            if factors is not None and not any(f.free_symbols & self.padded for f in factors):
                out.append(None)
            elif factors is not None and len(factors) == 1:
                out.append(factors[0])
            else:
                out.append(MIXED)
        return tuple(out)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload) and func.namespace in ("aten", "prims"):
            self._judge(func, args, kwargs, result)
        else:
            self._judge_unknown(func, args, kwargs, result)
        return result

    def _judge_unknown(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(any(d is not None for d in self.dims(t)) or id(t) in self.taint for t in tensors) \
                or free_symbols((args, kwargs)) & self.padded:
            for out in pytree.tree_leaves(result):
                if isinstance(out, torch.Tensor):
                    self.keep.append(out)
                    self.taint[id(out)] = f"{func} has no padding rule"

    def _judge(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        name = func._schema.name.split("::")[-1]
        bound = _bind(func, args, kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        self.keep += outs
        if name in ("scalar_tensor", "full") and len(outs) == 1 and outs[0].dim() == 0:
            number = bound.get("s", bound.get("fill_value"))
            if type(number) in (int, float, bool):
                self.constant[id(outs[0])] = number
        padded_in = any(any(d is not None for d in self.dims(t)) for t in tensors)
        inherited = next((self.taint[id(t)] for t in tensors if id(t) in self.taint), None)
        scalars = {k for k, v in bound.items()
                   if not isinstance(v, torch.Tensor) and free_symbols(v) & self.padded}
        if not padded_in and not scalars and inherited is None \
                and not any(any(d is not None for d in self.dims(t)) for t in outs):
            return   # nothing padded in or out: eager's values
        verdict = self._rule(func, name, bound, scalars)
        written = [bound[a.name] for a in func._schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write
                   and isinstance(bound.get(a.name), torch.Tensor)]
        if verdict is None:
            for t in outs:
                if any(t is w for w in written):
                    continue   # in place: the layout it had
                layout = self._result_layout(name, bound, tensors, t)
                if any(f is None and (_size(size).free_symbols & self.padded)
                       for f, size in zip(layout, t.shape)):
                    verdict = (f"aten.{name} makes a size {tuple(t.shape)} whose padded "
                               "positions cannot be told apart")
                    break
                self.layouts[id(t)] = layout
        # the first cause is the one worth naming
        reason = verdict if name in _FILLS or inherited is None else inherited
        if reason is not None and any(id(t) not in self.taint for t in written):
            raise Refused(f"aten.{name} writes in place where padding would change what it "
                          f"writes ({reason})")
        tags = set(func.tags)
        if name == "index" and not any(isinstance(i, torch.Tensor) and i.dtype in (
                torch.bool, torch.uint8) for i in bound["indices"]):
            # its tag is for boolean masks: long indices give a static shape
            tags.discard(torch.Tag.dynamic_output_shape)
        if (padded_in or inherited) and (torch.Tag.data_dependent_output in tags
                                         or torch.Tag.dynamic_output_shape in tags):
            raise Refused(f"aten.{name} reads values of a padded tensor into a size or a "
                          "Python value")
        if (padded_in or inherited) and not func._schema.returns:
            raise Refused(f"aten.{name} acts on a padded tensor for its effect")
        origin = None
        if name in _KEEPS_ORIGIN or name in _VIEWS or name in _SPLITS or name in ("slice",
                                                                                    "select"):
            origin = self.origin.get(id(tensors[0])) if tensors else None
        for t in outs:
            if reason is not None:
                self.taint[id(t)] = reason
            if any(t is w for w in written):
                for known in (self.origin, self.position, self.causal):
                    known.pop(id(t), None)
                continue
            if origin is not None:
                self.origin[id(t)] = origin
            if reason is None:
                self._follow_values(name, bound, tensors, t)

    # -- the rules: None where sound, else why not --------------------------------------

    def _rule(self, func: Any, name: str, bound: dict, scalars: set) -> Optional[str]:
        def tensor(arg: str) -> Optional[torch.Tensor]:
            value = bound.get(arg)
            return value if isinstance(value, torch.Tensor) else None

        def only(*allowed: str) -> Optional[str]:
            extra = sorted(scalars - set(allowed))
            if extra:
                return (f"aten.{name} uses a padded size as a value (its argument "
                        f"{extra[0]!r}): padding would change it")
            return None

        first = next((v for v in bound.values() if isinstance(v, torch.Tensor)), None)
        tags = set(func.tags)
        pointwise = torch.Tag.pointwise in tags or self._inplace_pointwise(func)
        if torch.Tag.inplace_view in tags:
            return f"aten.{name} changes a padded tensor's shape in place"
        if name in _ATTENTION:
            return only() or self._attention(name, bound)
        if torch.Tag.nondeterministic_seeded in tags:
            if any(any(d is not None for d in self.dims(t))
                   for t in pytree.tree_leaves(bound) if isinstance(t, torch.Tensor)) \
                    or scalars:
                return f"aten.{name} draws random numbers over a padded size"
            return None
        if pointwise or name in _MOVES:
            return only("size")
        if name in _FILLS:
            return only("size", "stride")
        if name == "arange":
            return None if self._arange_position(bound) is not None else (
                "aten.arange's bounds depend on a padded size other than as its end")
        if name in _VIEWS:
            return only("size", "shape")   # the result's layout says if it is sound
        if name in _SPLITS:
            dims = first is not None and self.dims(first)
            dim = int(bound.get("dim") or 0) % max(first.dim(), 1) if first is not None else 0
            if dims and dims[dim] is not None:
                return f"aten.{name} splits a padded dimension"
            return only()
        if name == "slice":
            return self._slice(bound, first, scalars)
        if name == "select":
            return self._select(bound, first, scalars)
        if name == "cat":
            dim = int(bound.get("dim") or 0)
            tensors = [t for t in bound["tensors"] if t.dim() > 0]
            along = [self.dims(t)[dim % t.dim()] for t in tensors]
            if any(a is not None for a in along[:-1]) or (along and along[-1] is MIXED):
                return "aten.cat joins along a padded dimension"   # not only at the end
            return only()
        if name == "constant_pad_nd":
            pads = list(bound["pad"])
            dims = self.dims(first)
            for i in range(len(pads) // 2):
                d = first.dim() - 1 - i
                if dims[d] is not None and (dims[d] is MIXED or type(pads[2 * i + 1]) is not int
                                            or pads[2 * i + 1] > 0):
                    return "aten.constant_pad_nd pads the end of a padded dimension"
            return only()
        if name in _CUMULATIVE:
            return only()
        if torch.Tag.reduction in tags or name in _OVER_DIMS:
            over = _norm_dims(bound.get("dim"), first.dim()) if first is not None else []
            return only() or self._over(name, first, over)
        if name in _NORMS:
            return only("N") or self._norm(name, first, bound)
        if name in _CONTRACTIONS:
            for arg, dim in _CONTRACTIONS[name]:
                t = tensor(arg)
                if t is not None and self.dims(t)[dim] is not None:
                    return f"aten.{name} sums over a padded dimension"
            return only()
        if name in _BATCHWISE:
            for arg, value in bound.items():
                if isinstance(value, torch.Tensor):
                    dims = self.dims(value)
                    if any(d is not None for d in (dims[1:] if value is first else dims)):
                        return (f"aten.{name} mixes positions of a padded dimension (only "
                                "its batch dimension may be padded)")
            return only()
        if name in _LOOKUPS:
            return only() or self._lookup(name, bound)
        return f"aten.{name} has no padding rule"

    @staticmethod
    def _inplace_pointwise(func: Any) -> bool:
        if torch.Tag.inplace not in func.tags or not func._schema.name.endswith("_"):
            return False
        base = func._schema.name.split("::")[-1][:-1]
        packet = getattr(torch.ops.aten, base, None)
        overload = getattr(packet, func._overloadname, None) if packet is not None else None
        return overload is not None and torch.Tag.pointwise in overload.tags

    def _arange_position(self, bound: dict) -> Optional[tuple]:
        end, start, step = bound.get("end"), bound.get("start"), bound.get("step")
        if not _is(start, None, 0) or not _is(step, None, 1):
            return None
        expr = sym_expr(end)
        symbol = _padded_symbol(expr, self.padded) if expr is not None else None
        return (0, symbol, 0) if symbol is not None else None

    # -- values that follow positions: aranges, and the causal masks made from them --

    def _follow_values(self, name: str, bound: dict, sources: list, out: torch.Tensor) -> None:
        first = sources[0] if sources else None
        if name == "arange":
            position = self._arange_position(bound)
            if position is not None:
                self.position[id(out)] = position
            return
        if first is None:
            return
        position = self.position.get(id(first))
        if position is not None:
            moved = self._moved_position(name, bound, first, out, position)
            if moved is not None:
                self.position[id(out)] = moved
        if name == "index":
            self._indexed_position(bound, out)
        if name in ("le", "lt", "ge", "gt") and len(sources) == 2:
            self._compared(name, sources[0], sources[1], out)
        causal = self.causal.get(id(first))
        if causal is not None and name in _POSITION_MOVES and not (
                name == "slice" and not _is(bound.get("start"), None, 0)):
            q = self._moved_dim(name, bound, first, out, causal[0])
            k = self._moved_dim(name, bound, first, out, causal[1])
            if q is not None and k is not None:
                self.causal[id(out)] = (q, k)
        if name == "where" and id(bound["condition"]) in self.causal:
            # masked positions (False) get `other`: a causal additive mask when that
            # is a number no logit survives against (-inf, the dtype's lowest)
            other = self._number(bound["other"])
            if type(other) in (int, float) and other <= -1e30:
                known = self.causal[id(bound["condition"])]
                shift = out.dim() - bound["condition"].dim()
                self.causal[id(out)] = (known[0] + shift, known[1] + shift)
        if name in ("bitwise_and", "logical_and", "mul", "__and__") \
                and out.dtype == torch.bool:
            for operand in sources:
                known = self.causal.get(id(operand))
                if known is not None:
                    shift = out.dim() - operand.dim()
                    self.causal[id(out)] = (known[0] + shift, known[1] + shift)
                    break

    def _number(self, value: Any) -> Any:
        """The number a scalar argument holds, where known: a Python number, a 0-d
        constant the graph made, or a real one-element tensor (a graph constant)."""
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in self.constant:
            return self.constant[id(value)]
        from torch._subclasses.fake_tensor import is_fake
        if not is_fake(value) and value.numel() == 1 and not value.requires_grad:
            return value.item()
        constant = getattr(value, "constant", None)   # a fake of a lifted constant
        return constant.item() if constant is not None and constant.numel() == 1 else None

    def _moved_position(self, name: str, bound: dict, source: torch.Tensor,
                        out: torch.Tensor, position: tuple) -> Optional[tuple]:
        dim, symbol, c = position
        if name in ("add", "sub") and type(bound.get("other")) is int \
                and _is(bound.get("alpha"), None, 1) and out.shape == source.shape:
            step = bound["other"] if name == "add" else -bound["other"]
            return (dim, symbol, c + step)
        if name not in _POSITION_MOVES or out.dtype not in _EXACT:
            return None   # (a narrower dtype could not hold every position)
        if name == "slice" and int(bound.get("dim") or 0) % source.dim() == dim:
            start = bound.get("start")
            if not _is(bound.get("step"), None, 1) or not (
                    start is None or (type(start) is int and start >= 0)):
                return None
            c += start or 0
        moved = self._moved_dim(name, bound, source, out, dim)
        return (moved, symbol, c) if moved is not None else None

    def _moved_dim(self, name: str, bound: dict, source: torch.Tensor, out: torch.Tensor,
                   d: int) -> Optional[int]:
        """Where dimension d of `source` is in `out`, for a move (None: gone or unknown)."""
        rank_in, rank_out = source.dim(), out.dim()
        if name in ("transpose", "transpose_copy"):
            a, b = int(bound["dim0"]) % rank_in, int(bound["dim1"]) % rank_in
            return b if d == a else a if d == b else d
        if name in ("permute", "permute_copy"):
            return [int(x) % rank_in for x in bound["dims"]].index(d)
        if name in ("t", "t_copy"):
            return rank_in - 1 - d
        if name in ("unsqueeze", "unsqueeze_copy"):
            return d + 1 if int(bound["dim"]) % rank_out <= d else d
        if name == "select":
            gone = int(bound["dim"]) % rank_in
            return None if gone == d else d - (gone < d)
        if name in ("squeeze", "squeeze_copy"):
            kept = [i for i in range(rank_in) if i == d or _size(source.shape[i]) != 1
                    or rank_in - rank_out == 0]
            return kept.index(d) if len(kept) == rank_out else None
        if name in _VIEWS:
            sizes_in = [_size(x) for x in source.shape]
            sizes_out = [_size(x) for x in out.shape]
            before = sympy.Mul(*sizes_in[:d])
            found = [e for e in range(rank_out) if sizes_out[e] == sizes_in[d]
                     and sympy.expand(sympy.Mul(*sizes_out[:e]) - before) == 0]
            return found[0] if len(found) == 1 else None
        return d + rank_out - rank_in   # same dimensions, or new ones in front

    def _indexed_position(self, bound: dict, out: torch.Tensor) -> None:
        """table[i0, i1, ...] of a table whose values follow positions along one
        dimension: the values follow the positions that dimension's index follows."""
        table, indices = bound["self"], bound["indices"]
        known = self.position.get(id(table))
        if known is None or len(indices) != table.dim() or any(
                not isinstance(i, torch.Tensor) for i in indices):
            return
        index = indices[known[0]]
        follows = self.position.get(id(index))
        if follows is not None:
            self.position[id(out)] = (follows[0] + out.dim() - index.dim(), follows[1],
                                      follows[2] + known[2])

    def _compared(self, name: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """A comparison of two aranges along different dimensions of one padded size:
        `k <= q` is False wherever k > q (a causal mask) when its offsets allow it."""
        pa, pb = self.position.get(id(a)), self.position.get(id(b))
        if pa is None or pb is None or pa[1] != pb[1]:
            return
        ra, rb = pa[0] + out.dim() - a.dim(), pb[0] + out.dim() - b.dim()
        if ra == rb or self.dims(out)[ra] != self.dims(out)[rb] or self.dims(out)[ra] is None:
            return
        if name in ("ge", "gt"):   # a >= b is b <= a
            ra, rb, pa, pb = rb, ra, pb, pa
            name = "le" if name == "ge" else "lt"
        # the left side's index k, the right side's q: left <= right (or <) is False
        # whenever k > q, given k's offset is not below q's (one less for <)
        if pa[2] + (1 if name == "lt" else 0) >= pb[2]:
            self.causal[id(out)] = (rb, ra)

    def _result_layout(self, name: str, bound: dict, sources: list,
                       out: torch.Tensor) -> tuple:
        """The layout of a result of a sound operation: moved with its dimensions
        for moves, regrouped for views, else taken from the operands' dimensions of
        the same size (aligned from the right, then from the left)."""
        first = sources[0] if sources else None
        if first is not None and first.dim() > 0:
            layout = list(self.layout(first))
            rank = first.dim()
            if name in _VIEWS:
                return self._regroup(layout, [_size(s) for s in out.shape])
            if name in ("transpose", "transpose_copy"):
                a, b = int(bound["dim0"]) % rank, int(bound["dim1"]) % rank
                layout[a], layout[b] = layout[b], layout[a]
                return tuple(layout)
            if name in ("permute", "permute_copy"):
                return tuple(layout[int(d) % rank] for d in bound["dims"])
            if name in ("t", "t_copy"):
                return tuple(reversed(layout))
            if name in ("unsqueeze", "unsqueeze_copy"):
                layout.insert(int(bound["dim"]) % out.dim(), ())
                return tuple(layout)
            if name in ("select", "unbind", "unbind_copy"):
                del layout[int(bound.get("dim") or 0) % rank]
                return tuple(layout)
            if name in ("squeeze", "squeeze_copy"):
                dim = bound.get("dim")
                dims = (set(range(rank)) if dim is None else
                        {int(d) % rank for d in (dim if isinstance(dim, (list, tuple)) else [dim])})
                return tuple(f for d, f in enumerate(layout)
                             if not (d in dims and _size(first.shape[d]) == 1))
        layout_out = []
        for k, size in enumerate(out.shape):
            found: list = []
            for t in sources:
                for j in (k + t.dim() - out.dim(), k):
                    if 0 <= j < t.dim() and _size(t.shape[j]) == _size(size) \
                            and _size(size) != 1:
                        found.append(self.layout(t)[j])
                        break
            known = [f for f in found if f is not None]
            if found and (len(known) < len(found) or any(f != known[0] for f in known)):
                layout_out.append(None)   # operands disagree on where padding lies
            else:
                layout_out.append(known[0] if known else self._derive(size))
        return tuple(layout_out)

    def _regroup(self, layout: list, sizes: list) -> tuple:
        """A view's layout: the operand's factors in row-major order, regrouped into
        the result's sizes; a padded factor must stay whole (None where it cannot)."""
        if any(f is None for f in layout):
            return tuple(None for _ in sizes)
        if any(s == -1 for s in sizes):
            total = sympy.Mul(*[f for factors in layout for f in factors])
            known = sympy.Mul(*[s for s in sizes if s != -1])
            sizes = [total / known if s == -1 else s for s in sizes]
        factors = _merge_clean([f for factors in layout for f in factors], self.padded)
        out: list = []
        i, rest = 0, None
        for size in sizes:
            need, got = sympy.sympify(size), []
            while need != 1:
                if rest is not None:
                    factor, rest = rest, None
                elif i < len(factors):
                    factor, i = factors[i], i + 1
                else:
                    return tuple(out) + (None,) * (len(sizes) - len(out))
                ratio = need / factor
                if sympy.fraction(ratio)[1] == 1:
                    got.append(factor)       # the factor whole, and more to come
                    need = ratio
                elif not (factor.free_symbols & self.padded) \
                        and not (need.free_symbols & self.padded) \
                        and sympy.fraction(factor / need)[1] == 1:
                    got.append(need)         # a size that is not padded, split
                    rest, need = factor / need, sympy.Integer(1)
                else:
                    return tuple(out) + (None,) * (len(sizes) - len(out))
            out.append(_merge_clean(got, self.padded))
        if rest is not None or i < len(factors):
            return tuple(None for _ in sizes)
        return tuple(out)

    def _slice(self, bound: dict, source: Optional[torch.Tensor], scalars: set) -> Optional[str]:
        dim = int(bound.get("dim") or 0)
        start, end, step = bound.get("start"), bound.get("end"), bound.get("step")
        padded = source is not None and self.dims(source)[dim % source.dim()] is not None
        if not padded:
            return None if not scalars else "aten.slice's bounds depend on a padded size"
        extent = self.dims(source)[dim % source.dim()]
        whole = _is(start, None, 0) and _is(step, None, 1) and (
            end is None or (type(end) is int and end >= 2 ** 62) or sym_expr(end) == extent)
        if whole:
            return None
        if extent is MIXED:
            return "aten.slice cuts merged padded dimensions"
        # Kept positions are the first n + c of an extent s + c: a slice from a start
        # k >= 0 to the end, to `end` positions before it, or to s + c' <= s + c keeps
        # the first ones (each result position reads a kept one); a start counted from
        # the end does not.
        if not _is(step, None, 1) or not (start is None or (type(start) is int and start >= 0)):
            return "aten.slice counts from the end of a padded dimension"
        if end is None or type(end) is int:
            return None   # to the end, before it, or a fixed prefix the guards keep below n
        symbol = _padded_symbol(sym_expr(end), self.padded)
        if symbol is not None and symbol == _padded_symbol(extent, self.padded) \
                and (extent - sym_expr(end)).is_nonnegative:
            return None
        return "aten.slice's bounds depend on a padded size"

    def _select(self, bound: dict, source: Optional[torch.Tensor], scalars: set) -> Optional[str]:
        if scalars:
            return "aten.select's index depends on a padded size"
        dim, index = int(bound["dim"]), bound["index"]
        symbol = self.dims(source)[dim % source.dim()]
        if symbol is None:
            return None
        if symbol is MIXED:
            return "aten.select picks a position of merged padded dimensions"
        # a kept position: below the smallest extent the symbol's range allows
        base = _padded_symbol(symbol, self.padded)
        lowest = self.ranges[base][0] + int(symbol - base)
        if type(index) is not int or index < 0 or index >= lowest:
            return "aten.select picks a position counted from the end of a padded dimension"
        return None

    def _over(self, name: str, source: Optional[torch.Tensor], over: list[int]) -> Optional[str]:
        if source is None:
            return None
        dims = self.dims(source)
        if any(dims[d] is not None for d in over if d < len(dims)):
            return f"aten.{name} reduces over a padded dimension"
        return None

    def _norm(self, name: str, source: torch.Tensor, bound: dict) -> Optional[str]:
        rank = source.dim()
        if name in ("native_layer_norm", "_fused_rms_norm"):
            over = list(range(rank - len(bound["normalized_shape"]), rank))
        elif name == "native_group_norm":
            over = list(range(1, rank))
        elif name == "_native_batch_norm_legit_no_training" or not bound.get("training", True):
            over = []
        else:
            over = [0] + list(range(2, rank))
        return self._over(name, source, over)

    def _attention(self, name: str, bound: dict) -> Optional[str]:
        query, key, value = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_mask", bound.get("attn_bias"))
        if not _is(bound.get("dropout_p"), None, 0, 0.0):
            return f"aten.{name} draws random numbers (dropout) over a padded size"
        q_len = self.dims(query)[-2]
        if self.dims(key)[-2] is None and self.dims(value)[-2] is None:
            if isinstance(mask, torch.Tensor) and self.dims(mask)[-1] is not None:
                return f"aten.{name}'s mask pads the key dimension"
            return None   # each query position alone
        same = q_len is not MIXED and q_len is not None \
            and q_len == self.dims(key)[-2] == self.dims(value)[-2]
        if bound.get("is_causal") and mask is None and same:
            return None   # a kept query sees only earlier keys, all kept
        if same and isinstance(mask, torch.Tensor) and not bound.get("is_causal") \
                and self.causal.get(id(mask)) == (mask.dim() - 2, mask.dim() - 1):
            return None   # the mask hides every later key from each query (False or -inf)
        return (f"aten.{name} attends over a padded key dimension without a causal "
                "mask (padded keys would be seen)")

    def _lookup(self, name: str, bound: dict) -> Optional[str]:
        table_arg, dim_arg, index_arg = _LOOKUPS[name]
        table = bound[table_arg]
        if name == "index":
            indexed = [(d, i) for d, i in enumerate(bound[index_arg]) if i is not None]
        else:
            d = dim_arg if isinstance(dim_arg, int) else int(bound[dim_arg]) % max(table.dim(), 1)
            indexed = [(d, bound[index_arg])]
        for d, index in indexed:
            along = self.dims(table)[d]
            value = self.position.get(id(index))
            if along is not None and along is not MIXED and value is not None \
                    and value[1] == _padded_symbol(along, self.padded) \
                    and self.dims(index)[value[0]] == along and value[2] == 0:
                continue   # position i of a padded dimension read at i: a kept one
            if along is not None:
                return f"aten.{name} looks up along a padded dimension"
            if not any(x is not None for x in self.dims(index)):
                continue
            if self.origin.get(id(index)) == "input":
                continue   # the padded positions hold copies of the caller's indices
            if value is not None and value[2] >= 0:
                size = table.shape[d]
                if sym_expr(size) is not None:
                    return f"aten.{name} looks up a table of symbolic size by position"
                # the largest index: the last padded position, S + c - 1, plus the offset
                symbol, extent = value[1], self.dims(index)[value[0]]
                c = int(extent - symbol) if extent is not MIXED and extent is not None else 0
                cap = int(size) - c - value[2]
                self.ceiling[symbol] = min(self.ceiling.get(symbol, cap), cap)
                continue
            return (f"aten.{name} looks up by padded indices the graph computed (padded "
                    "positions could index out of range)")
        return None
