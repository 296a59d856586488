"""Which calls of a capture make tensors whose shape depends on tensor *values*.

A shape that Python reads during a capture becomes a constant of the graph, and the
entry's guards vouch for it only through the input shapes that determine it.  That
holds for a tensor whose shape follows from its inputs' shapes and the call's
non-tensor arguments; not for one whose shape comes from data (`nonzero`, a boolean
mask, `repeat_interleave(counts)`, `pack_padded_sequence`, `arange(lengths.max())`).
The tracer marks the second kind (a shape query on it ends the capture) and asks this
module which calls make it.  torch answers, not a list of ours:

- Each aten op a recorded call dispatches is seen by `DataDependence`, a
  `TorchDispatchMode` active while a static capture runs for real.  An op tagged
  `dynamic_output_shape` is run again on fake copies of its arguments (a
  `FakeTensorMode` with a `ShapeEnv`): its output is data-dependent when the fake run
  makes an unbacked size or refuses to run without data.  That verdict depends on the
  arguments (`index` with a bool mask or with integer indices), so it is asked on
  every call.  An untagged op is asked the same way once per process and per
  argument dtypes: `_pack_padded_sequence` carries no tag, but its fake
  implementation makes an unbacked size.
- A call that read a tensor value into a scalar inside (an op tagged
  `data_dependent_output`: `aten.item`, the argument parser turning a 0-d tensor into
  a `Scalar`), or that took a tensor no dispatched op received (C++ that read it
  through its data pointer: `tensor_split(x, indices)`), is run once more as a whole
  on fake copies of its arguments, with the same test.  `torch.full((3,), t.max())`
  keeps its static shape; `torch.arange(t.max())` does not.
- A result with a sparse layout: its number of stored elements is data (torch's fake
  `coalesce` answers 0).

Opaque calls (modules with hooks, `register_op` ops) run user code for real: a
data-dependent op or a value read anywhere inside marks their results.

Only static captures use the mode: a symbolic capture runs on fakes, where such an
op makes an unbacked size directly (`has_unbacked_size`).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch._decomp import meta_table
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx.experimental.symbolic_shapes import (
    GuardOnDataDependentSymNode,
    ShapeEnv,
    free_unbacked_symbols,
)
from torch.utils._python_dispatch import TorchDispatchMode

from nnscaler_eval import _C
from nnscaler_eval.capture import fake_runs, unwinding

_DYNAMIC_SHAPE = torch.Tag.dynamic_output_shape
_VALUE_READ = torch.Tag.data_dependent_output
# The fake run could not go on without data: the output's shape needs it.
_NEEDS_DATA = (DynamicOutputShapeException, DataDependentOutputException,
               GuardOnDataDependentSymNode)

# Namespaces whose untagged ops are asked on fakes (torch's own operators).
_FAKE_CHECKED = frozenset({"aten", "prims"})
# What the mode does with an op, decided once per op (`_kind_of`).
_READS_VALUE = 0         # tagged data_dependent_output: the call read a tensor value
_TAGGED = 1              # tagged dynamic_output_shape: asked on fakes on every call
_TAGGED_ELSEWHERE = 2    # the same tag outside torch's namespaces: data-dependent
_UNTAGGED = 3            # torch's own, untagged, no meta kernel: asked once per dtypes
_PASSES = 4              # untagged with a meta kernel, or outside torch's namespaces
_kinds: dict[Any, int] = {}


def _kind_of(func: Any) -> int:
    tags = func.tags
    if _VALUE_READ in tags:
        return _READS_VALUE
    ours = func.namespace in _FAKE_CHECKED
    if _DYNAMIC_SHAPE in tags:
        return _TAGGED if ours else _TAGGED_ELSEWHERE
    # Collectives (c10d), backends' and users' custom ops: torch's fake run of one may
    # run its real kernel or talk to other ranks.  Their tags decide.
    if not ours:
        return _PASSES
    # A meta kernel computes the output's metadata from the inputs' metadata: that is
    # its contract (an op whose output shape needs data has none, or is tagged).
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "Meta") or \
            func in meta_table:
        return _PASSES
    return _UNTAGGED


# (aten op, argument dtypes and layouts) -> reason (None: the shape follows from
# metadata), for ops without the dynamic_output_shape tag: asked once per process.
_untagged_verdicts: dict[tuple[Any, tuple[Any, ...]], Optional[str]] = {}


_per_thread = threading.local()
_MAX_SYMBOLS = 1024


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of an op's arguments: positional, in lists, in keyword values."""
    found: list[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


def has_unbacked_size(value: Any) -> bool:
    """Does a (fake) result hold a tensor or number with an unbacked symbol?"""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            if free_unbacked_symbols(leaf):
                return True
    return False


def _sparse(value: Any) -> bool:
    return any(t.layout != torch.strided for t in _tensor_leaves(value))


class CallRecord:
    """What the ops of one call did: set by the mode while the call runs."""

    __slots__ = ("unseen", "reason", "read_value")

    def __init__(self, unseen: dict[int, torch.Tensor]) -> None:
        self.unseen = unseen          # tensor arguments no dispatched op received yet
        self.reason: Optional[str] = None   # why the results' shapes depend on data
        self.read_value = False       # an op read a tensor value into a scalar


class DataDependence(TorchDispatchMode):
    """The dispatch-level witness of one static capture (see the module docstring).

    `begin()` / `close()` bracket one call, `verdict()` judges it; records nest (an opaque module's call holds
    the ops of everything it runs).  With no record open, an op passes through.
    """

    # Higher-order ops (an eager `torch.cond` run for real) pass through: their
    # outputs have the shapes their branches agree on.
    supports_higher_order_operators = True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Not wrapped in Dynamo's disable: the wrapper imports torch._dynamo (about a
        second, and numpy.random with it) at the first op of the first capture."""
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Invisible to torch.compile: with any other dispatch mode active, Dynamo
        skips the frames it would compile (eager `torch.cond` would then run its
        branches without Dynamo's checks, and raise nothing where eager raises)."""
        return True

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CallRecord] = []
        # Fakes for one op: without a shape environment, an op whose output shape
        # needs data raises (DynamicOutputShapeException); and with one, for a call
        # that read a value: `full((3,), t.max())` keeps its shape, `arange(t.max())`
        # gets an unbacked size.  (A ShapeEnv imports torch._dynamo: only on demand.)
        self._fake_modes: dict[bool, FakeTensorMode] = {}

    @staticmethod
    def of_this_thread() -> "DataDependence":
        """The thread's witness (dispatch modes are per thread)."""
        mode = getattr(_per_thread, "mode", None)
        if mode is None:
            mode = _per_thread.mode = DataDependence()
        return mode

    def forget(self) -> None:
        """The outermost capture ended: drop its records (an interrupt's leftovers),
        and its fakes when their shape environment has grown (each data-dependent
        answer adds a symbol; the mode is otherwise kept, since making one costs
        more than the runs it serves)."""
        self.records.clear()
        symbolic = self._fake_modes.get(True)
        if symbolic is not None and len(symbolic.shape_env.var_to_range) > _MAX_SYMBOLS:
            del self._fake_modes[True]

    def on_stack(self) -> bool:
        """Is this mode on the thread's dispatch stack already (an enclosing capture
        pushed it)?"""
        return any(torch._C._get_dispatch_stack_at(i) is self
                   for i in range(torch._C._len_torch_dispatch_stack()))

    # -- the calls -----------------------------------------------------------------

    def begin(self, args: Any = ()) -> CallRecord:
        """Open a record for a call taking `args` (a recorded torch call: its tensor
        arguments are watched for one no op receives; an opaque call: none)."""
        record = CallRecord({id(t): t for t in _tensor_leaves(args)})
        self.records.append(record)
        return record

    def close(self, record: CallRecord) -> None:
        """The call of `record` returned or raised: its ops are seen no more."""
        if record in self.records:
            while self.records.pop() is not record:
                pass   # a record an interrupt left open

    def verdict(self, record: CallRecord, func: Any = None, args: tuple[Any, ...] = (),
                kwargs: Optional[dict[str, Any]] = None, result: Any = None) -> Optional[str]:
        """Why the results of `record`'s call (closed) have data-dependent shapes, or
        None.  With `func` (a torch call recorded as one node), a call that read a
        value or took a tensor no op received is run again on fakes to decide; without
        it (an opaque call) a value read decides on its own.
        """
        if record.reason is not None:
            return record.reason
        if _sparse(result):
            return "a sparse result (its number of stored elements is data)"
        if func is None:
            return ("it read a tensor value into a Python scalar inside"
                    if record.read_value else None)
        results = _tensor_leaves(result)
        if not results:
            return None
        for tensor in results:   # handed back unchanged (`x.to(x.dtype)`, eval dropout)
            record.unseen.pop(id(tensor), None)
        if not (record.read_value or record.unseen):
            return None
        if not _is_torch_callable(func):
            return (f"{_name(func)} read tensor data outside torch's dispatch"
                    if record.read_value else None)
        paused = _C.record_functions_pause()
        try:
            return self._fake_verdict(func, args, kwargs or {}, _name(func),
                                      presumed=record.read_value,
                                      symbolic=record.read_value)[0]
        finally:
            _C.record_functions_resume(paused)

    # -- the mode --------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        if kwargs is None:
            kwargs = {}
        records = self.records
        if not records or not isinstance(func, torch._ops.OpOverload):
            return func(*args, **kwargs)
        record = records[-1]
        tensors = _tensor_leaves((args, kwargs)) if args or kwargs else []
        if record.unseen:
            for tensor in tensors:
                record.unseen.pop(id(tensor), None)
        kind = _kinds.get(func)
        if kind is None:
            kind = _kinds[func] = _kind_of(func)
        if kind == _READS_VALUE:
            for open_record in records:
                open_record.read_value = True
        elif kind != _PASSES and record.reason is None and \
                not any(type(t) is FakeTensor for t in tensors):
            # What runs to decide is ours, not the forward's: not recorded as code
            # that ran (its names are not the forward's reads).
            paused = _C.record_functions_pause()
            try:
                reason = self._op_verdict(func, kind, args, kwargs, tensors)
            finally:
                _C.record_functions_resume(paused)
            if reason is not None:
                for open_record in records:
                    if open_record.reason is None:
                        open_record.reason = reason
        return func(*args, **kwargs)

    def _op_verdict(self, func: Any, kind: int, args: tuple[Any, ...],
                    kwargs: dict[str, Any], tensors: list[torch.Tensor]) -> Optional[str]:
        if kind == _TAGGED_ELSEWHERE:
            return f"{func} is tagged dynamic_output_shape"
        if kind == _TAGGED:
            if _runs_on_meta(func, args, kwargs):
                return None
            return self._fake_verdict(func, args, kwargs, str(func), presumed=True)[0]
        signature = (func, *[(t.dtype, t.layout) for t in tensors])
        try:
            return _untagged_verdicts[signature]
        except KeyError:
            pass
        if _runs_on_meta(func, args, kwargs):
            verdict, settled = None, True
        else:
            verdict, settled = self._fake_verdict(func, args, kwargs, str(func),
                                                  presumed=False)
        if settled:
            _untagged_verdicts[signature] = verdict
        return verdict

    # -- the fake run ------------------------------------------------------------------

    def _fake_verdict(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      name: str, presumed: bool, symbolic: bool = False
                      ) -> tuple[Optional[str], bool]:
        """Run `func` on fake copies of its arguments: why its result's shape depends on
        data (None when the fake run computed it from metadata alone), and whether
        that answer holds for other arguments of the same dtypes.

        A fake run that fails for another reason (an op fake tensors do not support,
        a nested tensor, a shape error eager raises too, a library's patch of torch)
        says nothing of data: then `presumed` decides, True where torch's tag or a
        value read inside the call already suggests data-dependence, and the answer
        is not kept for other calls."""
        mode = self._fake_modes.get(symbolic)
        if mode is None:
            # No fallback kernels: an op without a fake implementation would run for
            # real on zeros, and a shape computed from zeros is no answer.
            mode = self._fake_modes[symbolic] = FakeTensorMode(
                shape_env=ShapeEnv() if symbolic else None, static_shapes=True,
                allow_fallback_kernels=False)
        # The fake run's own ops are not the capture's.
        records, self.records = self.records, []
        try:
            fake_args, fake_kwargs = pytree.tree_map_only(
                torch.Tensor, mode.from_tensor, (args, kwargs))
            with mode, fake_runs.quiet():
                result = func(*fake_args, **fake_kwargs)
        except _NEEDS_DATA:
            return f"{name} needs tensor data to know its output's shape", True
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            if unwinding.interrupt_in(exc) is not None:   # torch's error masking Ctrl-C
                raise
            if "data" in str(exc):   # "Cannot access data pointer", "data is not allocated"
                return f"{name} reads tensor data to compute its output's shape", True
            if not presumed:
                return None, False
            return (f"{name} could not be run on fake tensors ({type(exc).__name__}), so "
                    "its output's shape is not known to follow from its inputs' shapes",
                    False)
        finally:
            self.records = records
        if has_unbacked_size(result):
            return f"{name} makes an output whose shape depends on tensor data", True
        return None, True


def _runs_on_meta(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Does the op run on meta copies of its arguments?  Then its output's shape came
    from metadata alone: a meta tensor has no data to read.  (No fake tensor mode: the
    first one of a process imports torch._dynamo, about a second, so fakes are asked
    only about the ops that fail here.)"""
    def meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_nested or type(value) not in (
                    torch.Tensor, torch.nn.Parameter) or value.device.type == "meta":
                raise _NotMetaCopyable
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                       device="meta")
        if isinstance(value, (list, tuple)):
            return type(value)(meta(v) for v in value) if type(value) in (list, tuple) \
                else value
        return value

    try:
        meta_args = tuple(meta(a) for a in args)
        meta_kwargs = {k: meta(v) for k, v in kwargs.items()}
        with torch._C.DisableTorchFunction():
            func(*meta_args, **meta_kwargs)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:   # _NotMetaCopyable, an op with no meta kernel, a data read
        if unwinding.interrupt_in(exc) is not None:
            raise
        return False
    return True


class _NotMetaCopyable(Exception):
    pass


def _is_torch_callable(func: Any) -> bool:
    """One of torch's own functions (running it again on fakes has no other effect)."""
    module = getattr(func, "__module__", None) or ""
    if module == "torch" or module.startswith("torch."):
        return True
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    return owner is torch.Tensor or owner is torch._C.TensorBase or (
        isinstance(owner, type) and owner.__module__ in ("torch", "torch._C"))


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
