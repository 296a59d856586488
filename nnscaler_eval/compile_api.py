"""`nnscaler.compile`: modules in place, module classes, and plain functions."""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional

import torch

from nnscaler_eval import _C
from nnscaler_eval.config import CompileConfig
from nnscaler_eval.runners import inductor_start


def compile(
    obj: Any = None,
    *,
    backend: Any = "eager",
    fullgraph: bool = False,
    skip_nnmodule_hook_guards: bool = False,
    cache_size_limit: int = 8,
    dynamic: Optional[bool] = None,
    block_reuse: bool = True,
    size_buckets: bool = False,
) -> Any:
    """Compile an `nn.Module` instance (in place; returns the same object), an
    `nn.Module` subclass (every instance is compiled) or a plain function (returns a
    wrapper).  Usable bare (`@nnscaler.compile`) or with arguments.

    Each `forward` is captured into a torch.fx graph on its first call with a new
    input signature, guarded, cached per code object and run by `backend` afterwards.

    `dynamic`: None (default) captures sizes and int arguments as they are, and makes
    the ones seen changing symbolic at the next capture (one graph then serves every
    value its guards allow); True makes every dimension of the tensor arguments and
    every int argument symbolic from the first capture; False specialises every
    capture on exact sizes and values.

    `block_reuse`: True (default) compiles a repeated block once.  With a backend that
    compiles through AOTAutograd ("inductor", "aot_eager"), the submodule calls of a
    capture that trace to the same operations over inputs of the same metadata (the
    layers of a transformer) become one subgraph, which the graph calls once per
    instance with that instance's parameters and buffers; a block that differs in
    anything its graph depends on keeps its own.  `explain()` lists what is shared.
    False hands the backend the whole graph inlined.

    `size_buckets`: False (default) records a dynamic capture once per size with a
    backend that needs concrete sizes ("cudagraphs").  True runs a size through the
    recording of the next power of two, its arguments padded and its outputs cut
    back, where the graph's operations keep padded positions from reaching the others
    (causal attention, per-position layers; not a mask over padded keys, a reduction
    over the padded dimension or `x[:, -1]`); `explain()` says which sizes are padded,
    or why none.
    """
    config = CompileConfig.create(backend, fullgraph, skip_nnmodule_hook_guards,
                                  cache_size_limit, dynamic, block_reuse, size_buckets)
    if obj is None:
        return functools.partial(_compile_with, config=config)
    return _compile_with(obj, config=config)


def _compile_with(obj: Any, config: CompileConfig) -> Any:
    if isinstance(obj, torch.nn.Module):
        install_on_module(obj, config)
        return obj
    if isinstance(obj, type):
        if issubclass(obj, torch.nn.Module):
            return _compile_class(obj, config)
        raise TypeError(
            f"nnscaler.compile(): {obj.__qualname__} is a class but not an nn.Module subclass"
        )
    if isinstance(obj, types.MethodType) and isinstance(obj.__func__, types.FunctionType):
        return types.MethodType(_compile_function(obj.__func__, config), obj.__self__)
    if isinstance(obj, types.FunctionType):
        return _compile_function(obj, config)
    if isinstance(obj, _C.CompiledFunction):
        return _compile_function(obj._nnscaler_fn, config)
    raise TypeError(
        "nnscaler.compile() takes an nn.Module instance, an nn.Module subclass or a Python "
        f"function; got {type(obj).__name__}"
    )


def install_on_module(module: torch.nn.Module, config: CompileConfig) -> None:
    # nn.Module._wrapped_call_impl calls _compiled_call_impl in place of _call_impl
    # (the hook torch's own Module.compile() uses); state_dict() is untouched.
    module._compiled_call_impl = _C.ModuleCall(module, config)
    # Inductor's start for CPU code runs beside what comes before the first call.
    inductor_start.begin_for(config.backend_name, module)


def _compile_function(fn: types.FunctionType, config: CompileConfig) -> Any:
    compiled = _C.CompiledFunction(fn, config)
    functools.update_wrapper(compiled, fn)
    return compiled


def _compile_class(cls: type, config: CompileConfig) -> type:
    original_init: Callable[..., None] = cls.__init__  # type: ignore[misc]

    @functools.wraps(original_init)
    def __init__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        install_on_module(self, config)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


def is_compiled(module: torch.nn.Module) -> bool:
    return isinstance(module.__dict__.get("_compiled_call_impl"), _C.ModuleCall)


def compiled_config(obj: Any) -> Optional[CompileConfig]:
    if isinstance(obj, torch.nn.Module):
        call = obj.__dict__.get("_compiled_call_impl")
        return call.config if isinstance(call, _C.ModuleCall) else None
    if isinstance(obj, _C.CompiledFunction):
        return obj.config
    return None
