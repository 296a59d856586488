"""`nnscaler.export(module, *args, **kwargs)`: one capture, in the form nnScaler consumes.

The result is a `torch.fx.GraphModule` whose

- placeholders are the tensor inputs (leaves of the arguments, in signature order),
  then one bool per module whose `training` flag is used as a value: `training` for
  the root, `<path>_training` for a submodule (defaulting to the flag's value at export
  time, so `gm(x)` runs in the module's current mode);
- `a if self.training else b` expressions are `ifexpr` nodes calling
  `nnscaler.runtime.function.ifexpr`, and the code says so by that name;
- functions registered with `nnscaler.register_op` are single `call_function` nodes;
- `torch.cond` is one `torch.ops.higher_order.cond` node with its branch GraphModules;
- every node computed by user code carries `meta["source_loc"]` ("file:line") and
  `meta["stack_trace"]` (the user's line, in traceback form);
- parameters and buffers are the module's own (get_attr of its live submodules).

Design note: the export runs the forward once for real, as a call would (it is the
same concrete trace `nnscaler.compile` uses; BatchNorm statistics in train mode are
updated once). A forward that cannot be captured in one graph raises `ExportError`
naming the reason and the user's line. `if self.training:` statements specialise the
graph to the current mode (nnScaler's rule for `if` statements); export warns when
that happened.
"""
from __future__ import annotations

import importlib
from collections import namedtuple
import inspect
import re
import types
import warnings
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from nnscaler_eval import _C
from nnscaler_eval.capture import Capture, GraphBreakError, capture, dynamic, unwinding
from nnscaler_eval.eval_frame import enable
from nnscaler_eval.register_op import registered_ops
from nnscaler_eval.rewrite import rewritten_function
from nnscaler_eval.runners.codegen import SlotOutput
from nnscaler_eval.runtime import ifexpr

_IFEXPR_PATH = f"{ifexpr.__module__}.{ifexpr.__name__}"  # nnscaler.runtime.function.ifexpr
# What `nnscaler` means in the generated code: just the path to our ifexpr. Not the
# `nnscaler` package, which is built on nnscaler_eval (or is Microsoft nnScaler's).
_PUBLIC_PATH = types.SimpleNamespace(
    runtime=types.SimpleNamespace(function=types.SimpleNamespace(ifexpr=ifexpr)))


class ExportError(RuntimeError):
    """The forward cannot be exported as one graph; `.fallback` says why and where."""

    def __init__(self, message: str, fallback: Any = None) -> None:
        super().__init__(message)
        self.fallback = fallback


class _NnscalerCodeGen(fx.graph.CodeGen):
    """fx's code, with `ifexpr` written by its public path (`nnscaler.runtime.function
    .ifexpr(...)`) instead of a mangled global name."""

    def _gen_python_code(self, *args: Any, **kwargs: Any) -> fx.graph.PythonCode:
        code = super()._gen_python_code(*args, **kwargs)
        names = [name for name, value in code.globals.items() if value is ifexpr]
        if names:
            for name in names:
                code.src = re.sub(rf"\b{re.escape(name)}\(", f"{_IFEXPR_PATH}(", code.src)
            code.globals["nnscaler"] = _PUBLIC_PATH
        return code


def export(module: nn.Module, *args: Any, dynamic_dims: Optional[dict] = None,
           **kwargs: Any) -> fx.GraphModule:
    """Capture `module(*args, **kwargs)` into one GraphModule (see the module docstring).

    `dynamic_dims` ({argument name: dimension or dimensions}), or `mark_dynamic` marks
    on the tensors passed: those sizes are symbolic in the graph (`x.size(1)` nodes,
    not constants; capture/dynamic.py).  A marked size the forward fixes to its value
    raises ExportError naming it and the line that read it; the other conditions the
    graph assumes are in `gm.meta["shape_guards"]`.
    """
    result, _ = _capture_for_export(module, args, kwargs, "nnscaler.export()",
                                    dynamic_dims)
    gm = _exported_module(result, module)
    if "shape_guards" in result.graph_module.meta:
        gm.meta["shape_guards"] = result.graph_module.meta["shape_guards"]
    return gm


def _symbolic_inputs(fn: Any, slots: tuple, slot_names: tuple, dynamic_dims: Optional[dict],
                     where: str) -> Any:
    """The fake arguments of a symbolic export, or None when nothing is marked."""
    values, names = slots[1:], slot_names[1:]
    fields: set = set()
    for name, dims in (dynamic_dims or {}).items():
        if name not in names:
            raise ValueError(f"nnscaler.export: dynamic_dims names {name!r}, which is not an "
                             f"argument of {where} ({', '.join(names)})")
        value = values[names.index(name)]
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"nnscaler.export: dynamic_dims: {name!r} is a "
                             f"{type(value).__name__}, not a tensor")
        fields.update((names.index(name), d) for d in dynamic._dims_of(value, dims, "export"))
    fields |= dynamic.marked_dims(values)
    if not fields:
        return None
    if fn.__code__.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS):
        raise ValueError(f"nnscaler.export: dynamic dimensions need a forward without "
                         f"*args/**kwargs ({where})")
    key = _C.CallKey(*values)
    candidates = dynamic.candidates(key, values)
    for index, dim in sorted(fields, key=str):
        if (index, dim) not in candidates:
            raise ValueError(f"nnscaler.export: {names[index]} dimension {dim} cannot be "
                             "symbolic (only sizes of plain tensor arguments can)")
    symbolic = dynamic.SymbolicInputs(frozenset(fields), key, values, names)
    for index, dim in fields:
        if values[index].shape[dim] in (0, 1):
            raise ExportError(f"nnscaler.export: {names[index]}.size({dim}) is "
                              f"{values[index].shape[dim]} in the example: sizes 0 and 1 are "
                              "never symbolic; export with an example of size 2 or more", None)
    return symbolic


def _capture_for_export(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                        caller: str, dynamic_dims: Optional[dict] = None,
                        python_values: bool = False
                        ) -> tuple[Capture, inspect.BoundArguments]:
    """One capture of `module(*args, **kwargs)` for an export.  `python_values`: the
    numbers, shapes and dicts that flow from the arguments are graph values
    (capture/python_values.py), as nnScaler's generated module needs them."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{caller} takes an nn.Module, got {type(module).__name__}")
    forward = type(module).forward
    where = _where(forward)
    fn = rewritten_function(forward)
    try:
        bound = inspect.signature(fn).bind(module, *args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{caller}: arguments do not match {where}: {exc}") from None
    bound.apply_defaults()
    slots = _slots(fn, bound)
    slot_names = tuple(fn.__code__.co_varnames[: len(slots)])
    symbolic = _symbolic_inputs(fn, slots, slot_names, dynamic_dims, where)
    if symbolic is not None:
        slots = slots[:1] + symbolic.values
    try:
        # Rewrite mode: submodule forwards, inlined by the tracer, run rewritten too.
        # An interrupt leaves nothing behind (capture/unwinding.py).
        with unwinding.Boundary(), enable():
            result = capture(
                fn,
                slots,
                slot_names,
                root=module,
                fullgraph=symbolic is None,
                call=(None if python_values else (lambda: fn(*slots)) if symbolic is not None
                      else (lambda: fn(*bound.args, **bound.kwargs))),
                symbolic=symbolic,
                python_values=python_values,
            )
    except GraphBreakError as exc:
        raise _export_error(where, exc.fallback) from None
    except dynamic.Unsupported as exc:
        raise ExportError(f"nnscaler.export: {where} cannot be captured with symbolic "
                          f"sizes: {exc}", None) from None
    if symbolic is not None:
        fixed = symbolic.specialised()
        if fixed:
            raise ExportError(f"nnscaler.export: {where}: a dimension marked dynamic was "
                              f"fixed to its value: {'; '.join(fixed)}", None)
        try:
            _, _, words = symbolic.guard_program()
        except dynamic.Unsupported as exc:
            raise ExportError(f"nnscaler.export: {where}: {exc}", None) from None
        if result.graph_module is not None:
            result.graph_module.meta["shape_guards"] = words
    if result.fallback is not None or result.graph_module is None:
        raise _export_error(where, result.fallback)
    if result.state_writes:
        # The compiled runner writes these again on every call; a graph cannot.
        written = ", ".join(f"{type(m).__name__}.{name} = {value!r}"
                            for m, name, _, value in result.state_writes)
        warnings.warn(f"nnscaler.export: {where} writes module state ({written}); the "
                      "exported graph computes the outputs only, without those writes",
                      RuntimeWarning, stacklevel=3)
    return result, bound


def _where(forward: Any) -> str:
    code = getattr(forward, "__code__", None)
    if code is None:
        return getattr(forward, "__qualname__", "forward")
    return f"{code.co_qualname} ({code.co_filename}:{code.co_firstlineno})"


def _export_error(where: str, fallback: Any) -> ExportError:
    return ExportError(
        f"nnscaler.export: {where} cannot be captured in one graph: {fallback}", fallback
    )


def _slots(fn: Any, bound: inspect.BoundArguments) -> tuple[Any, ...]:
    """The frame's argument slots in CPython's order (what the C side passes)."""
    code = fn.__code__
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & inspect.CO_VARARGS)
    count += bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return tuple(bound.arguments[name] for name in code.co_varnames[:count])


def _exported_module(result: Capture, module: nn.Module) -> fx.GraphModule:
    source = result.graph_module
    assert source is not None and result.runner_spec is not None
    graph = fx.Graph()
    graph._codegen = _NnscalerCodeGen()
    val_map: dict[fx.Node, fx.Node] = {}
    flat = graph.graph_copy(source.graph, val_map)
    assert isinstance(flat, tuple)

    # Training flags default to their value at export time.
    flags = iter(result.training_inputs)
    for node in graph.nodes:
        if node.op == "placeholder" and node.meta.get("nnscaler_input", 0) is None:
            flag_module = next(flags)
            node.args = (bool(flag_module.training),)

    # The forward's own output structure where fx can write it (tuples, lists, dicts).
    layout = result.runner_spec.output
    leaves = layout.leaf_values(flat.__getitem__, lambda slot: None)
    output: Any = tuple(flat)
    if _plain_structure(layout.spec) and not any(isinstance(x, SlotOutput) for x in layout.leaves):
        output = pytree.tree_unflatten(leaves, layout.spec)
    graph.output(output)
    graph.lint()

    gm = ExportedGraphModule(source, graph, class_name=type(module).__name__ + "Graph")
    keep_buffer_persistence(gm, module)
    gm.meta["nnscaler_training_inputs"] = [
        _module_path(module, m) for m in result.training_inputs
    ]
    if result.branched_training:
        names = ", ".join(
            f"{_module_path(module, m) or type(m).__name__}.training={v}"
            for m, v in result.branched_training
        )
        warnings.warn(
            f"nnscaler.export: the forward branches on `training` ({names}); the exported "
            "graph holds the branch taken in that mode only",
            stacklevel=3,
        )
    return gm


class ExportedGraphModule(fx.GraphModule):
    """An exported GraphModule that pickles its graph, not its code.

    fx's own `GraphModule.__reduce__` saves the generated Python and re-traces it on
    load, which drops every node's `meta` (source lines, nnScaler's metadata) and
    cannot name a registered op by import path (the op's wrapper is not the module
    attribute of that name). This one saves a copy of the graph (nodes, targets, meta),
    the attributes its `get_attr` nodes read, `meta` and buffer persistence; call
    targets that pickle cannot find by name (our `ifexpr`, registered ops) travel as
    `_TargetRef`s and are looked up again on load (a registered op's module is
    imported, so its registration runs).
    """

    def __reduce__(self) -> Any:
        graph = fx.Graph()
        graph._codegen = self.graph._codegen
        env: dict[fx.Node, fx.Node] = {}
        for node in self.graph.nodes:
            target = node.target
            if node.op == "call_function":
                target = _TargetRef.of(target) or target
            new = graph.create_node(
                node.op, target, fx.node.map_arg(node.args, env.__getitem__),
                fx.node.map_arg(node.kwargs, env.__getitem__), name=node.name,
                type_expr=node.type)
            new.meta = _portable(dict(node.meta), _to_portable)
            env[node] = new
        attrs = {n.target: _fetch_attr(self, n.target) for n in graph.nodes if n.op == "get_attr"}
        non_persistent = [
            f"{path}.{name}" if path else name
            for path, sub in self.named_modules() for name in sub._non_persistent_buffers_set
        ]
        return (_rebuild_exported, (attrs, graph, type(self).__name__, dict(self.meta),
                                    non_persistent))


class _MemoryFormat:
    """`torch.memory_format` by name: torch.save's pickle protocol 2 cannot save one
    (nnScaler's `tensor_meta` holds them)."""

    def __init__(self, name: str) -> None:
        self.name = name


def _to_portable(value: Any) -> Any:
    if isinstance(value, torch.memory_format):
        return _MemoryFormat(str(value).rpartition(".")[2])
    return value


def _from_portable(value: Any) -> Any:
    if isinstance(value, _MemoryFormat):
        return getattr(torch, value.name)
    return value


def _portable(value: Any, leaf: Any) -> Any:
    """`leaf` applied through dicts, lists and (named) tuples."""
    if isinstance(value, dict) and type(value) is dict:
        return {k: _portable(v, leaf) for k, v in value.items()}
    if type(value) is list:
        return [_portable(v, leaf) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        items = [_portable(v, leaf) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return leaf(value)


class _TargetRef:
    """A call target pickled by what it is, not by its (shadowed) import path."""

    def __init__(self, kind: str, name: str, module: Optional[str]) -> None:
        self.kind, self.name, self.module = kind, name, module

    @staticmethod
    def of(target: Any) -> Optional["_TargetRef"]:
        if target is ifexpr:
            return _TargetRef("ifexpr", "ifexpr", None)
        op_name = getattr(target, "op_name", None)
        if getattr(target, "__nnscaler_op__", None) is not None or isinstance(op_name, str):
            if not isinstance(op_name, str):
                return None
            return _TargetRef("op", op_name, getattr(target, "__module__", None))
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # fx wants a callable target
        return self.resolve()(*args, **kwargs)

    def resolve(self) -> Any:
        if self.kind == "ifexpr":
            return ifexpr
        ops = registered_ops()
        if self.name not in ops and self.module and self.module != "__main__":
            importlib.import_module(self.module)  # its register_op call runs
            ops = registered_ops()
        if self.name not in ops:
            raise RuntimeError(f"loading an exported graph: the op {self.name!r} is not "
                               f"registered (import the module that registers it, "
                               f"{self.module!r}, first)")
        op = ops[self.name]
        return getattr(op, "__nnscaler_eval_op__", op)


def _rebuild_exported(attrs: dict[str, Any], graph: fx.Graph, class_name: str,
                      meta: dict[str, Any], non_persistent: list[str]) -> fx.GraphModule:
    for node in graph.nodes:
        if isinstance(node.target, _TargetRef):
            node.target = node.target.resolve()
        node.meta = _portable(node.meta, _from_portable)
    gm = ExportedGraphModule(attrs, graph, class_name=class_name)
    gm.meta.update(meta)
    for qualified in non_persistent:
        path, _, name = qualified.rpartition(".")
        owner = gm.get_submodule(path)
        if name in owner._buffers:
            owner._non_persistent_buffers_set.add(name)
    return gm


def _fetch_attr(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def keep_buffer_persistence(gm: fx.GraphModule, module: nn.Module) -> None:
    """Mark the buffers the export copied from non-persistent buffers of `module` as
    non-persistent in `gm` too (fx registers every copied tensor as a persistent
    buffer)."""
    for path, sub in gm.named_modules():
        if not sub._buffers:
            continue
        try:
            owner = module.get_submodule(path)
        except AttributeError:
            continue
        for name in sub._buffers:
            if name in owner._non_persistent_buffers_set:
                sub._non_persistent_buffers_set.add(name)


def _plain_structure(spec: pytree.TreeSpec, named_tuples: bool = False) -> bool:
    """Containers fx writes into a graph's output: tuples, lists, dicts with str keys,
    and with `named_tuples` named tuples and torch's structseqs (`x.max(dim)`)."""
    if spec.is_leaf():
        return True
    if spec.type not in (tuple, list, dict, type(None)) and not (
            named_tuples and (spec.type is namedtuple or _structseq(spec.type))):
        return False
    if spec.type is dict and not all(isinstance(k, str) for k in spec.context):
        return False
    return all(_plain_structure(child, named_tuples) for child in spec.children())


def _structseq(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "n_fields")


def _module_path(root: nn.Module, module: nn.Module) -> str:
    for name, candidate in root.named_modules():
        if candidate is module:
            return name
    return type(module).__name__
