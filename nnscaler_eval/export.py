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

import inspect
import re
import warnings
from typing import Any

import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from nnscaler_eval.codegen import ConstantOutput, GraphOutput, SlotOutput
from nnscaler_eval.runtime import ifexpr
from nnscaler_eval.tracer import Capture, GraphBreakError, capture

_IFEXPR_PATH = f"{ifexpr.__module__}.{ifexpr.__name__}"  # nnscaler.runtime.function.ifexpr


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
            import nnscaler

            for name in names:
                code.src = re.sub(rf"\b{re.escape(name)}\(", f"{_IFEXPR_PATH}(", code.src)
            code.globals["nnscaler"] = nnscaler
        return code


def export(module: nn.Module, *args: Any, **kwargs: Any) -> fx.GraphModule:
    """Capture `module(*args, **kwargs)` into one GraphModule (see the module docstring)."""
    result, _ = _capture_for_export(module, args, kwargs, "nnscaler.export()")
    return _exported_module(result, module)


def _capture_for_export(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                        caller: str) -> tuple[Capture, inspect.BoundArguments]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{caller} takes an nn.Module, got {type(module).__name__}")
    from nnscaler_eval.eval_frame import enable
    from nnscaler_eval.rewrite import rewritten_function

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
    try:
        # Rewrite mode: submodule forwards, inlined by the tracer, run rewritten too.
        with enable():
            result = capture(
                fn,
                slots,
                slot_names,
                root=module,
                fullgraph=True,
                call=lambda: fn(*bound.args, **bound.kwargs),
            )
    except GraphBreakError as exc:
        raise _export_error(where, exc.fallback) from None
    if result.fallback is not None or result.graph_module is None:
        raise _export_error(where, result.fallback)
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
    leaves: list[Any] = []
    for leaf in layout.leaves:
        if isinstance(leaf, GraphOutput):
            leaves.append(flat[leaf.index])
        elif isinstance(leaf, ConstantOutput):
            leaves.append(leaf.value)
        else:
            assert isinstance(leaf, SlotOutput)
            leaves.append(None)
    output: Any = tuple(flat)
    if _plain_structure(layout.spec) and not any(isinstance(x, SlotOutput) for x in layout.leaves):
        output = pytree.tree_unflatten(leaves, layout.spec)
    graph.output(output)
    graph.lint()

    gm = fx.GraphModule(source, graph, class_name=type(module).__name__ + "Graph")
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


def _plain_structure(spec: pytree.TreeSpec) -> bool:
    if spec.is_leaf():
        return True
    if spec.type not in (tuple, list, dict, type(None)):
        return False
    if spec.type is dict and not all(isinstance(k, str) for k in spec.context):
        return False
    return all(_plain_structure(child) for child in spec.children())


def _module_path(root: nn.Module, module: nn.Module) -> str:
    for name, candidate in root.named_modules():
        if candidate is module:
            return name
    return type(module).__name__
