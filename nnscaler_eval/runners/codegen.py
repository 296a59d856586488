"""Straight-line Python for a captured graph: the runners that the C hit path calls.

A runner is a flat function `runner(*slots, *training_flags) -> output`. The C side
calls it on every cache hit, so its body is what a careful person would write by hand:

- locals only; parameters, buffers, constants and call targets are globals of the
  generated function (one dict lookup each, no attribute chains);
- method calls as `x.view(...)`, dunder operators as `a + b`, containers as literals;
- each intermediate dropped (`name = None`) after its last use, so peak memory matches
  eager instead of holding every activation until the return;
- a value used once, right away, as the first argument of the next call, written into
  that call (`x.view(...).transpose(...)`), as eager code reads: no store, load or
  `= None` for it;
- the output rebuilt as a literal when it is made of tuples, lists and dicts (no
  per-call pytree walk); other pytree types go through `tree_unflatten` with a bound
  spec.

Modules are never bound as globals when the capture has a root module: a runner lives
in a cache entry, and a module reference there would keep the model alive. A module
is reached from the root slot through its `_modules` dicts instead.

The source is registered with `linecache` under `<nnscaler graph Qual.name>`, so
tracebacks and `inspect.getsource` show it; each block is preceded by a comment naming
the user's line that produced it.
"""

from __future__ import annotations

import ast
import builtins
import keyword
import linecache
import math
import operator
import os
import re
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union, cast

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from nnscaler_eval import _C
from nnscaler_eval.runners import direct_calls
from nnscaler_eval.runners.backends import PerSizeCompiled
from nnscaler_eval.runtime import ifexpr
from nnscaler_eval.tracing.trace_patches import REAL_SET_GRAD_ENABLED

# ---------------------------------------------------------------------------
# What the tracer hands over


@dataclass(frozen=True)
class GraphOutput:
    """An output leaf computed by the graph: element `index` of the graph's output tuple."""

    index: int


@dataclass(frozen=True)
class ConstantOutput:
    """An output leaf that does not depend on the inputs (None, a shape, a string...)."""

    value: Any


@dataclass(frozen=True)
class SlotOutput:
    """An output leaf that is one of the frame's argument slots, passed through."""

    slot: int


@dataclass(frozen=True)
class RebuiltOutput:
    """An output leaf that is an object the forward built around graph outputs (a
    transformers KV cache): a fresh object of the same class and layout per call.

    `shape` is nested tuples: ("object", cls, ((attribute, shape), ...)) for an object
    made with `object.__new__(cls)` and its `__dict__` filled; ("list" | "tuple",
    (shape, ...)); ("dict", ((key, shape), ...)); ("graph", i) for the graph's i-th
    output; ("constant", value) for an immutable value; ("input", InputPath) for an
    object passed in (a KV cache argument), which is returned as itself.
    """

    shape: tuple


OutputLeaf = Union[GraphOutput, ConstantOutput, SlotOutput, RebuiltOutput]


@dataclass(frozen=True)
class OutputLayout:
    """How to rebuild the forward's return value from the graph's flat output tuple."""

    spec: pytree.TreeSpec
    leaves: tuple[OutputLeaf, ...]
    # What the forward wrote into KV caches passed in, performed after the graph
    # (capture/passed_objects.py): ("set", InputPath, attribute, shape), ("del",
    # InputPath, attribute), ("items", InputPath, shape of the new list or dict);
    # shapes as RebuiltOutput's.
    writes: tuple[tuple, ...] = ()

    def leaf_values(self, graph_output: Callable[[int], Any],
                    slot: Callable[[int], Any]) -> list[Any]:
        """The leaves of the return value: `graph_output(i)` for the graph's i-th
        output, the constant itself, `slot(i)` for an argument returned as it is."""
        values: list[Any] = []
        for leaf in self.leaves:
            if isinstance(leaf, GraphOutput):
                values.append(graph_output(leaf.index))
            elif isinstance(leaf, ConstantOutput):
                values.append(leaf.value)
            elif isinstance(leaf, RebuiltOutput):
                raise TypeError("an output rebuilt as an object has no graph form")
            else:
                values.append(slot(leaf.slot))
        return values


@dataclass(frozen=True)
class InputPath:
    """Where a tensor placeholder sits in the slots: `slots[slot]` then `keys` (pytree)."""

    slot: int
    keys: tuple[Any, ...]


@dataclass(frozen=True)
class RunnerSpec:
    """Everything needed to write a runner for one capture.

    Placeholder nodes carry `meta["nnscaler_input"]`: an `InputPath` for a tensor input,
    or None for a training flag (flags come after all tensor inputs, in `flag_names`
    order). The runner takes one parameter per flag name even when the graph has no
    flag placeholders left (flags folded for a backend): the C side always passes them.
    """

    name: str  # e.g. "Model.forward", used in the code's filename
    graph: fx.Graph
    attr_values: Mapping[str, Any]  # get_attr / call_module target -> object
    slot_names: tuple[str, ...]
    root_slot: Optional[int]  # the slot holding the root module, if any
    module_paths: Mapping[str, str]  # target of a module of the root's tree -> its path
    output: OutputLayout
    entry_grad_mode: bool  # grad mode when the graph starts (restored on exceptions)
    flag_names: tuple[str, ...] = ()  # the runner's training-flag parameters
    # Plain values the forward wrote to modules of the root's tree, written again
    # after the graph: (the module's path from the root, attribute, value).
    state_writes: tuple[tuple[str, str, Any], ...] = ()


# ---------------------------------------------------------------------------
# Naming


# Builtins the generated code itself refers to: no local may shadow them.
_BUILTINS_USED = frozenset({"slice", "getattr", "setattr", "abs", "float", "BaseException", "None"})
_IDENTIFIER_ILLEGAL = re.compile(r"[^0-9a-zA-Z_]+")

# Short, familiar prefixes for the modules most graph targets come from.
_MODULE_PREFIXES = {
    "torch": "torch",
    "torch._C._VariableFunctions": "torch",
    "torch.functional": "torch",
    "torch._C._nn": "F",
    "torch.nn.functional": "F",
    "torch._C._fft": "fft",
    "torch._C._linalg": "linalg",
    "torch._C._special": "special",
    "torch._C": "torch_C",
    "_operator": "operator",
    "operator": "operator",
}


class _Namespace:
    """Unique, valid Python identifiers for one generated function (locals and globals)."""

    def __init__(self) -> None:
        self._used: set[str] = set(keyword.kwlist) | set(_BUILTINS_USED)

    def fresh(self, hint: str) -> str:
        base = _IDENTIFIER_ILLEGAL.sub("_", hint).strip("_") or "v"
        if base[0].isdigit():
            base = "_" + base
        name, n = base, 0
        while name in self._used:
            n += 1
            name = f"{base}_{n}"
        self._used.add(name)
        return name


def _autograd_apply(target: Any) -> bool:
    """Is `target` `SomeFunction.apply` of a torch.autograd.Function subclass?"""
    owner = getattr(target, "__self__", None)
    return (isinstance(target, types.MethodType) and isinstance(owner, type)
            and issubclass(owner, torch.autograd.Function)
            and getattr(target, "__name__", None) == "apply")


def _target_hint(target: Any) -> str:
    """`F_linear`, `torch_relu`, `STE_apply`: short, and never a local's name."""
    name = getattr(target, "__name__", None) or type(target).__name__
    prefix = _MODULE_PREFIXES.get(getattr(target, "__module__", None) or "")
    if prefix is not None:
        return f"{prefix}_{name}"
    qualname = getattr(target, "__qualname__", None) or name
    return "fn_" + qualname.replace("<locals>.", "").replace(".", "_")


# ---------------------------------------------------------------------------
# Writer


_BINARY_OPERATORS = {
    operator.add: "+",
    operator.sub: "-",
    operator.mul: "*",
    operator.truediv: "/",
    operator.floordiv: "//",
    operator.mod: "%",
    operator.pow: "**",
    operator.matmul: "@",
    operator.and_: "&",
    operator.or_: "|",
    operator.xor: "^",
    operator.lshift: "<<",
    operator.rshift: ">>",
    operator.eq: "==",
    operator.ne: "!=",
    operator.lt: "<",
    operator.le: "<=",
    operator.gt: ">",
    operator.ge: ">=",
}
_UNARY_OPERATORS = {operator.neg: "-", operator.pos: "+", operator.invert: "~"}

# Functions that only change global torch state; the runner restores that state if the
# graph raises half-way (eager `with` blocks would have).
_STATE_FUNCTIONS = (REAL_SET_GRAD_ENABLED,)
_AUTOCAST_ENTER = torch.amp.autocast_mode._enter_autocast
_AUTOCAST_EXIT = torch.amp.autocast_mode._exit_autocast

# Reentrant: _forget_source runs from a weakref finalizer, which the GC can run on
# this thread while _register_source holds the lock (an allocation in its loop).
# Held through _C.call_holding: `with lock:` is not interrupt-safe on 3.13+
# (csrc/held_lock.h; tests/test_interrupts.py hung on it).
_filename_lock = threading.RLock()

_COND = torch.ops.higher_order.cond
_WHILE = torch.ops.higher_order.while_loop
# Calls whose first argument is not evaluated first, or that are statements.
_NOT_INLINED_INTO = frozenset({ifexpr, _COND, _WHILE, operator.setitem, setattr})


def while_loop_in_python(cond_fn: Callable[..., Any], body_fn: Callable[..., Any],
                         carried: tuple[Any, ...], additional: tuple[Any, ...]) -> tuple[Any, ...]:
    """What torch.ops.higher_order.while_loop computes, in plain Python: the runner's
    way of running the node (autograd as in eager: torch's while_loop autograd gives
    wrong gradients when the loop runs zero times, torch 2.13)."""
    while cond_fn(*carried, *additional):
        carried = tuple(body_fn(*carried, *additional))
    return carried
_MAX_INLINE_DEPTH = 8


def _as_operand(expression: str) -> str:
    """`expression` as it may stand wherever a name did: a call, attribute or
    subscript as it is, anything else (operators, conditionals) in parentheses."""
    tree = ast.parse(expression, mode="eval").body
    if isinstance(tree, (ast.Call, ast.Attribute, ast.Subscript, ast.Name)):
        return expression
    return f"({expression})"


def _uses(user: fx.Node, node: fx.Node) -> int:
    """How many times `node` appears in `user`'s arguments."""
    count = 0

    def visit(arg: Any) -> Any:
        nonlocal count
        count += arg is node
        return arg

    fx.node.map_arg((user.args, user.kwargs), visit)
    return count


class _RunnerWriter:
    def __init__(self, spec: RunnerSpec, compiled: Optional[Callable[..., Any]]) -> None:
        self.spec = spec
        self.compiled = compiled
        self.names = _Namespace()
        self.globals: dict[str, Any] = {"__builtins__": builtins}
        self._bound: dict[int, str] = {}
        self._keepalive: list[Any] = []  # objects whose ids key _bound
        self.values: dict[fx.Node, str] = {}  # node -> expression naming its value
        self.lines: list[str] = []
        # nodes whose type at hit time is their type at capture (direct_calls.py)
        self.trusted: set[fx.Node] = set()

    # -- globals ---------------------------------------------------------------

    def bind(self, obj: Any, hint: str) -> str:
        """A global name for `obj` in the generated function (one per object)."""
        name = self._bound.get(id(obj))
        if name is None:
            name = self.names.fresh(hint)
            self.globals[name] = obj
            self._bound[id(obj)] = name
            self._keepalive.append(obj)
        return name

    def module_expr(self, target: str) -> str:
        """An expression for the module at `target`: a path from the root slot."""
        spec = self.spec
        path = spec.module_paths.get(target)
        if path is None or spec.root_slot is None:
            # Only without a root: nothing in a cache holds the model through this.
            return self.bind(spec.attr_values[target], target.replace(".", "_") or "module")
        return self.path_expr(path)

    def path_expr(self, path: str) -> str:
        """The module at `path` ("" for the root, "layers.0.attn") from the root slot."""
        assert self.spec.root_slot is not None
        expr = self.param_names[self.spec.root_slot]
        if path:
            for part in path.split("."):
                expr += f"._modules[{part!r}]"
        return expr

    # -- rendering of arguments ------------------------------------------------

    def render(self, arg: Any) -> str:
        if isinstance(arg, fx.Node):
            return self.values[arg]
        if arg is None or isinstance(arg, (bool, str)):
            return repr(arg)
        if isinstance(arg, int):
            return repr(int(arg))
        if isinstance(arg, float):
            if math.isfinite(arg):
                return repr(float(arg))
            return self.bind(float(arg), "inf" if arg > 0 else ("neg_inf" if arg < 0 else "nan"))
        if isinstance(arg, complex) and math.isfinite(arg.real) and math.isfinite(arg.imag):
            return repr(complex(arg))
        if isinstance(arg, tuple):
            items = [self.render(a) for a in arg]
            if hasattr(arg, "_fields"):  # a named tuple: rebuild its type
                return f"{self.bind(type(arg), type(arg).__name__)}({', '.join(items)})"
            if len(items) == 1:
                return f"({items[0]},)"
            return f"({', '.join(items)})"
        if isinstance(arg, list):
            return f"[{', '.join(self.render(a) for a in arg)}]"
        if isinstance(arg, dict):
            items = [f"{self.render_key(k)}: {self.render(v)}" for k, v in arg.items()]
            return "{" + ", ".join(items) + "}"
        if isinstance(arg, slice):
            return (
                f"slice({self.render(arg.start)}, {self.render(arg.stop)}, {self.render(arg.step)})"
            )
        if arg is Ellipsis:
            return "..."
        if isinstance(arg, (torch.dtype, torch.layout, torch.memory_format)):
            return self.bind(arg, str(arg).replace(".", "_"))
        if isinstance(arg, torch.device):
            return self.bind(arg, f"device_{arg}")
        if isinstance(arg, nn.Module):
            raise TypeError("modules reach the graph as get_attr / call_module nodes")
        return self.bind(arg, f"const_{type(arg).__name__}")

    def render_key(self, key: Any) -> str:
        if key is None or isinstance(key, (bool, int, str)):
            return repr(key)
        return self.render(key)

    def render_index(self, index: Any) -> str:
        """The text between the brackets of `x[...]`: slices as `a:b`, tuples bare."""

        def one(item: Any) -> str:
            if isinstance(item, slice):
                parts = [
                    "" if p is None else self.render(p) for p in (item.start, item.stop, item.step)
                ]
                text = f"{parts[0]}:{parts[1]}"
                return text + (f":{parts[2]}" if parts[2] else "")
            return self.render(item)

        if isinstance(index, tuple) and not hasattr(index, "_fields"):
            if not index:
                return "()"
            if len(index) == 1:
                return one(index[0]) + ","
            return ", ".join(one(i) for i in index)
        return one(index)

    def render_operand(self, arg: Any) -> str:
        text = self.render(arg)
        # A negative constant needs parentheses: `(-1) ** x` is not `-1 ** x`.
        if text.startswith("-"):
            return f"({text})"
        return text

    def call_args(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        parts = [self.render(a) for a in args]
        parts += [f"{k}={self.render(v)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    # -- the function ------------------------------------------------------------

    def write(self) -> str:
        spec = self.spec
        graph_nodes = list(spec.graph.nodes)
        placeholders = [n for n in graph_nodes if n.op == "placeholder"]

        # Parameters: one per slot, then one per training flag.
        self.param_names = [self.names.fresh(s) for s in spec.slot_names]
        flag_params = [self.names.fresh(f) for f in spec.flag_names]
        params = self.param_names + flag_params
        body: list[str] = []
        flags = iter(flag_params)
        for node in placeholders:
            source = node.meta.get("nnscaler_input")
            if source is None:  # a training flag
                self.values[node] = next(flags)
            elif not source.keys:
                self.values[node] = self.param_names[source.slot]
            else:
                self.values[node] = self.input_expr(source)

        if self.compiled is not None:
            args = ", ".join(self.values[n] for n in placeholders)
            out = self.names.fresh("out")
            if isinstance(self.compiled, PerSizeCompiled):
                # The size's compiled graph, looked up here (C calls only); a size not
                # met before calls back into PerSizeCompiled once.
                size = self.names.fresh("size")
                compiled = self.names.fresh("compiled")
                table = self.bind(self.compiled.compiled, "compiled_sizes")
                build = self.bind(self.compiled.compile_for, "compile_size")
                keys = "".join(f"getattr({self.values[n]}, 'shape', {self.values[n]}), "
                               for n in placeholders)
                body.append(f"{size} = ({keys})")
                body.append(f"{compiled} = {table}.get({size})")
                body.append(f"if {compiled} is None:")
                body.append(f"    {compiled} = {build}({size}, {args})")
            else:
                compiled = self.bind(self.compiled, "compiled_graph")
            body.append(f"{out} = {compiled}({args})")
            returned = self.output_expr(lambda i: f"{out}[{i}]", body)
        else:
            returned = self.write_graph(graph_nodes, body)

        if spec.state_writes:
            # The forward's writes of plain values to module state, after the graph
            # as after eager's forward (what it returns is computed first).
            result = self.names.fresh("result")
            body.append(f"{result} = {returned}")
            for path, name, value in spec.state_writes:
                body.append(f"setattr({self.path_expr(path)}, {name!r}, {self.render(value)})")
            returned = result

        header = f"def forward({', '.join(params)}):"
        lines = [header]
        if self.compiled is None and self._touches_global_state(graph_nodes):
            lines.append("    try:")
            lines += ["        " + line for line in body]
            lines.append(f"        return {returned}")
            lines.append("    except BaseException:")
            lines += ["        " + line for line in self._restore_state_lines(graph_nodes)]
            lines.append("        raise")
        else:
            lines += ["    " + line for line in body]
            lines.append(f"    return {returned}")
        return "\n".join(lines) + "\n"

    def input_expr(self, source: InputPath) -> str:
        expr = self.param_names[source.slot]
        for key in source.keys:
            if isinstance(key, pytree.SequenceKey):
                expr += f"[{key.idx}]"
            elif isinstance(key, pytree.MappingKey):
                expr += f"[{self.render_key(key.key)}]"
            elif isinstance(key, pytree.GetAttrKey):
                expr += f".{key.name}"
            else:
                # convert_frame turns this into a warning and an uncached call
                raise TypeError(
                    f"nnscaler codegen: cannot reach input {source!r} of slot "
                    f"{self.param_names[source.slot]!r}: pytree key {key!r} "
                    f"({type(key).__name__}) is not an index, mapping key or attribute"
                )
        return expr

    def object_writes(self, leaf_value: Callable[[int], str], body: list[str]) -> None:
        """What the forward wrote into KV caches passed in, written again: every target
        is found first (a write may replace the list a later target is reached
        through), then each write goes into the object's `__dict__` or the
        container, as eager's forward left them."""
        targets: dict[InputPath, str] = {}
        for write in self.spec.output.writes:
            if write[1] not in targets:
                targets[write[1]] = name = self.names.fresh("target")
                body.append(f"{name} = {self.input_expr(write[1])}")
        for kind, where, *rest in self.spec.output.writes:
            target = targets[where]
            if kind == "set":
                value = self.rebuilt_expr(rest[1], leaf_value, body)
                body.append(f"{target}.__dict__[{rest[0]!r}] = {value}")
            elif kind == "del":
                body.append(f"del {target}.__dict__[{rest[0]!r}]")
            else:
                value = self.rebuilt_expr(rest[0], leaf_value, body)
                if rest[0][0] == "list":
                    body.append(f"{target}[:] = {value}")
                else:
                    body.append(f"{target}.clear(); {target}.update({value})")

    def output_expr(self, leaf_value: Callable[[int], str], body: list[str]) -> str:
        layout = self.spec.output
        self.object_writes(leaf_value, body)
        texts = []
        for leaf in layout.leaves:
            if isinstance(leaf, GraphOutput):
                texts.append(leaf_value(leaf.index))
            elif isinstance(leaf, SlotOutput):
                texts.append(self.param_names[leaf.slot])
            elif isinstance(leaf, RebuiltOutput):
                texts.append(self.rebuilt_expr(leaf.shape, leaf_value, body))
            else:
                texts.append(self.render(leaf.value))
        literal = _literal_structure(layout.spec, iter(texts), self)
        if literal is not None:
            return literal
        spec_name = self.bind(layout.spec, "out_spec")
        unflatten = self.bind(pytree.tree_unflatten, "tree_unflatten")
        return f"{unflatten}([{', '.join(texts)}], {spec_name})"

    def rebuilt_expr(self, shape: tuple, leaf_value: Callable[[int], str],
                     body: list[str]) -> str:
        """The expression of a RebuiltOutput's `shape`; an object is made by statements
        appended to `body` (`object.__new__`, then its `__dict__` updated: C calls
        only, no Python frame on the hit path)."""
        kind = shape[0]
        if kind == "graph":
            return leaf_value(shape[1])
        if kind == "constant":
            return self.render(shape[1])
        if kind == "input":
            return self.input_expr(shape[1])
        if kind in ("list", "tuple"):
            items = [self.rebuilt_expr(s, leaf_value, body) for s in shape[1]]
            if kind == "list":
                return f"[{', '.join(items)}]"
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        if kind == "dict":
            items = [f"{self.render_key(k)}: {self.rebuilt_expr(s, leaf_value, body)}"
                     for k, s in shape[1]]
            return "{" + ", ".join(items) + "}"
        assert kind == "object", shape
        fields = [f"{name!r}: {self.rebuilt_expr(s, leaf_value, body)}" for name, s in shape[2]]
        cls = self.bind(shape[1], shape[1].__name__)
        name = self.names.fresh(shape[1].__name__.lower())
        body.append(f"{name} = {self.bind(object.__new__, 'new_object')}({cls})")
        body.append(f"{name}.__dict__.update({{{', '.join(fields)}}})")
        return name

    def write_graph(self, graph_nodes: list[fx.Node], body: list[str]) -> str:
        position = {node: i for i, node in enumerate(graph_nodes)}
        self.trusted = direct_calls.trusted_nodes(graph_nodes, self.spec.attr_values)
        # Extract nested inputs once, at the top, if the graph uses them.
        for node in graph_nodes:
            if node.op != "placeholder" or not node.users:
                continue
            source = node.meta.get("nnscaler_input")
            if source is not None and source.keys:
                name = self.names.fresh(node.name)
                body.append(f"{name} = {self.values[node]}")
                self.values[node] = name
        for node in graph_nodes:
            if node.op == "get_attr":
                target = str(node.target)
                value = self.spec.attr_values[target]
                if isinstance(value, fx.GraphModule) and node.users and all(
                    u.target is _COND or u.target is _WHILE for u in node.users
                ):
                    # A torch.cond branch or while_loop graph: a generated function.
                    self.values[node] = self.bind(
                        make_branch_runner(value, f"{self.spec.name}.{target}"), target
                    )
                elif isinstance(value, nn.Module):
                    self.values[node] = self.module_expr(target)
                else:
                    self.values[node] = self.bind(value, node.name)

        def emitted(node: fx.Node) -> bool:
            # An unused element of a tuple result is not worth a line.
            return node.op in ("call_function", "call_method", "call_module") and not (
                node.meta.get("nnscaler_unpack") and not node.users
            )

        # Values that die at a node: free them right after it, as eager would.
        dies_at: dict[fx.Node, list[fx.Node]] = {}
        for node in graph_nodes:
            if node.op in ("call_function", "call_method", "call_module") or (
                node.op == "placeholder"
                and node.meta.get("nnscaler_input") is not None
                and node.meta["nnscaler_input"].keys
            ):
                users = [u for u in node.users if emitted(u)]
                if users and all(u.op != "output" for u in node.users):
                    last = max(users, key=position.__getitem__)
                    dies_at.setdefault(last, []).append(node)

        inlined = self._inlined_values([n for n in graph_nodes if emitted(n)])
        carried: list[fx.Node] = []
        last_location = None
        for node in graph_nodes:
            if not emitted(node):
                continue
            location = node.meta.get("nnscaler_source")
            if location is not None and location != last_location:
                body.append(_location_comment(location))
                last_location = location
            if node in inlined:
                # what dies at it dies at its user's line, the next one
                self.values[node] = _as_operand(self.expression(node))
                carried += dies_at.get(node, ())
                continue
            statement = self.statement(node)
            dying, carried = carried + dies_at.get(node, []), []
            dead = [self.values[d] for d in dying if d in self.values and d not in inlined]
            if dead:
                statement += "; " + " = ".join(dead) + " = None"
            body.append(statement)

        output = next(n for n in reversed(graph_nodes) if n.op == "output")
        results = cast(tuple, output.args[0])
        return self.output_expr(lambda i: self.render(results[i]), body)

    def _inlined_values(self, emitted: list[fx.Node]) -> set[fx.Node]:
        """The values written into their one use instead of a line of their own: used
        once, by the next line, as its call's first argument (a method's receiver, an
        operator's left operand, a function's first argument: what that call evaluates
        first, after names only), from the same line of the user's code.  As eager
        code reads, and four bytecodes less per value (its store, its load, and the
        `= None` that freed it; the value dies as the call returns, as it did).  Not
        into a call written twice (a direct call's two forms) or into a conditional,
        and chains stop at _MAX_INLINE_DEPTH."""
        inlined: set[fx.Node] = set()
        depth: dict[fx.Node, int] = {}
        for node, user in zip(emitted, emitted[1:]):
            if (
                len(node.users) != 1
                or next(iter(node.users)) is not user
                or not user.args
                or user.args[0] is not node
                or _uses(user, node) != 1
                or node.meta.get("nnscaler_source") != user.meta.get("nnscaler_source")
                or user.target in _NOT_INLINED_INTO
                or direct_calls.lower(user, self.trusted) is not None
            ):
                continue
            level = depth.get(node, 0) + 1
            if level > _MAX_INLINE_DEPTH:
                continue
            depth[user] = level
            inlined.add(node)
        return inlined

    def statement(self, node: fx.Node) -> str:
        """One line computing `node`, binding its value if anything uses it."""
        expr = self.expression(node)
        if expr.startswith("\0"):  # a statement, not an expression (x[i] = v)
            return expr[1:]
        if not node.users:
            return expr
        name = self.names.fresh(node.name)
        self.values[node] = name
        return f"{name} = {expr}"

    def expression(self, node: fx.Node) -> str:
        """`node`'s call; where torch's C entry point does exactly what the wrapper the
        user called would (direct_calls.py), that call, the wrapper kept for when a
        TorchFunctionMode is active."""
        direct = direct_calls.lower(node, self.trusted)
        if direct is None:
            return self.called_expression(node)
        mode_active = self.bind(direct_calls.MODE_ACTIVE, "torch_function_mode_active")
        return f"{self.called_expression(node)} if {mode_active}() else {self.direct_expression(direct)}"

    def direct_expression(self, call: direct_calls.DirectCall) -> str:
        def one(arg: Any) -> str:
            if isinstance(arg, direct_calls.CallAtRunTime):
                return f"{self.bind(arg.function, _target_hint(arg.function))}()"
            return self.render(arg)

        parts = [one(a) for a in call.args]
        if call.method is not None:
            receiver, parts = self.render_operand(call.args[0]), parts[1:]
        parts += [f"{k}={one(v)}" for k, v in call.kwargs.items()]
        if call.method is not None:
            return f"{receiver}.{call.method}({', '.join(parts)})"
        function = self.bind(call.function, "C_" + _target_hint(call.function))
        return f"{function}({', '.join(parts)})"

    def called_expression(self, node: fx.Node) -> str:
        """`node`'s call as the user made it."""
        args, kwargs = node.args, node.kwargs
        if node.op == "call_method":
            receiver = self.render_operand(args[0])
            return f"{receiver}.{node.target}({self.call_args(args[1:], kwargs)})"
        if node.op == "call_module":
            module = self.module_expr(str(node.target))
            if node.meta.get("nnscaler_hooked"):
                # its hooks run with the evaluator out of the way (csrc/hooked_call.c)
                call = self.bind(_C.call_hooked, "C_call_hooked")
                items = "".join(f"{self.render(a)}, " for a in args)
                pairs = ", ".join(f"{k!r}: {self.render(v)}" for k, v in kwargs.items())
                return f"{call}({module}, ({items}), {{{pairs}}})"
            if type(self.spec.attr_values[str(node.target)]).__call__ is not nn.Module.__call__:
                # The node is nn.Module.__call__ (what the trace intercepted): a class's
                # own __call__ around super().__call__() was traced into the graph.
                base = self.bind(nn.Module, "Module")
                return f"{base}.__call__({module}, {self.call_args(args, kwargs)})"
            return f"{module}({self.call_args(args, kwargs)})"
        target = node.target
        if not kwargs:
            if target in _BINARY_OPERATORS and len(args) == 2:
                left, right = self.render_operand(args[0]), self.render_operand(args[1])
                return f"{left} {_BINARY_OPERATORS[target]} {right}"
            if target in _UNARY_OPERATORS and len(args) == 1:
                return f"{_UNARY_OPERATORS[target]}{self.render_operand(args[0])}"
            if target is operator.abs:
                return f"abs({self.render(args[0])})"
            if target is operator.getitem:
                return f"{self.render_operand(args[0])}[{self.render_index(args[1])}]"
            if target is operator.setitem:
                index, value = self.render_index(args[1]), self.render(args[2])
                return f"\0{self.render_operand(args[0])}[{index}] = {value}"
            if target is getattr and isinstance(args[1], str) and args[1].isidentifier():
                return f"{self.render_operand(args[0])}.{args[1]}"
            if target is setattr and isinstance(args[1], str) and args[1].isidentifier():
                return f"\0{self.render_operand(args[0])}.{args[1]} = {self.render(args[2])}"
            if target is ifexpr:
                cond, true_value, false_value = (self.render(a) for a in args)
                return f"{true_value} if {cond} else {false_value}"
            if target is _COND and all(a in self.values for a in args[1:3]):
                # Plain Python, not the HOP: one branch call, autograd as in eager.
                pred, true_fn, false_fn = (self.render(a) for a in args[:3])
                operands = ", ".join(self.render(a) for a in args[3])
                return f"{true_fn}({operands}) if {pred} else {false_fn}({operands})"
            if target is _WHILE and all(a in self.values for a in args[0:2]):
                loop = self.bind(while_loop_in_python, "while_loop_in_python")
                cond_fn, body_fn = (self.render(a) for a in args[:2])
                carried, additional = ("".join(self.render(a) + ", " for a in group)
                                       for group in args[2:4])
                return f"{loop}({cond_fn}, {body_fn}, ({carried}), ({additional}))"
        function = self.bind(target, _target_hint(target))
        if ((node.meta.get("nnscaler_opaque") and isinstance(target, types.FunctionType))
                or _autograd_apply(target)):
            # a register_op op written in Python, or an autograd Function's apply (its
            # forward in Python): their frames run with the evaluator out of the way,
            # as a hooked submodule's hooks do (csrc/hooked_call.c)
            disarmed = self.bind(_C.call_disarmed, "C_call_disarmed")
            rest = self.call_args(args, kwargs)
            return f"{disarmed}({function}{', ' + rest if rest else ''})"
        return f"{function}({self.call_args(args, kwargs)})"

    # -- global state ------------------------------------------------------------

    @staticmethod
    def _touches_global_state(graph_nodes: list[fx.Node]) -> bool:
        return any(
            n.op == "call_function"
            and (n.target in _STATE_FUNCTIONS or n.target is _AUTOCAST_ENTER)
            for n in graph_nodes
        )

    def _restore_state_lines(self, graph_nodes: list[fx.Node]) -> list[str]:
        """Undo what the graph did to global state when it raises half-way.

        Autocast contexts are exited innermost first (those not yet exited are the
        ones whose variable is still set); then grad mode goes back to its entry value.
        """
        lines: list[str] = []
        contexts = [
            n for n in graph_nodes if n.op == "call_function" and n.target is _AUTOCAST_ENTER
        ]
        if contexts:
            exit_name = self.bind(_AUTOCAST_EXIT, "autocast_exit")
            for ctx in reversed(contexts):
                name = self.values.get(ctx)
                if name is not None:
                    # Declared at the top (see below) so that the name is always bound.
                    lines.append(f"if {name} is not None: {exit_name}({name})")
        grad = self.bind(REAL_SET_GRAD_ENABLED, "torch_C__set_grad_enabled")
        lines.append(f"{grad}({self.spec.entry_grad_mode!r})")
        return lines


def _literal_structure(spec: pytree.TreeSpec, leaves: Any, writer: _RunnerWriter) -> Optional[str]:
    """The output as a literal if the spec is only tuples, lists, dicts and None."""
    if spec.is_leaf():
        return next(leaves)
    kind = spec.type
    children = spec.children()
    if kind is type(None):
        return "None"
    if kind in (tuple, list):
        items = []
        for child in children:
            text = _literal_structure(child, leaves, writer)
            if text is None:
                return None
            items.append(text)
        if kind is list:
            return f"[{', '.join(items)}]"
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if kind is dict:
        keys = spec.context
        if not all(k is None or isinstance(k, (bool, int, str)) for k in keys):
            return None
        items = []
        for key, child in zip(keys, children):
            text = _literal_structure(child, leaves, writer)
            if text is None:
                return None
            items.append(f"{key!r}: {text}")
        return "{" + ", ".join(items) + "}"
    return None


def _location_comment(location: tuple[str, int]) -> str:
    filename, lineno = location
    code = linecache.getline(filename, lineno).strip()
    text = f"# {os.path.basename(filename)}:{lineno}"
    return f"{text}: {code}" if code else text


def _declare_autocast_contexts(
    source_lines: list[str], writer: _RunnerWriter, graph: fx.Graph
) -> None:
    """Bind every autocast context variable to None first, for the except block."""
    names = [
        writer.values[n]
        for n in graph.nodes
        if n.op == "call_function" and n.target is _AUTOCAST_ENTER and n in writer.values
    ]
    if names:
        source_lines.insert(1, "    " + " = ".join(names) + " = None")


def _register_source(name: str, source: str) -> tuple[str, Any]:
    """A fresh `<nnscaler graph ...>` filename, with `source` in linecache under it;
    returns the filename and the cache entry (to remove exactly that entry later)."""
    return _C.call_holding(_filename_lock, _register_source_locked, name, source)


def _register_source_locked(name: str, source: str) -> tuple[str, Any]:
    base = f"<nnscaler graph {name}"
    filename, n = base + ">", 1
    while filename in linecache.cache:
        n += 1
        filename = f"{base} #{n}>"
    entry = (len(source), None, source.splitlines(True), filename)
    linecache.cache[filename] = entry
    return filename, entry


def _forget_source(filename: str, entry: Any) -> None:
    # Only our own entry: the name may have been reused once a finalizer ran late.
    _C.call_holding(_filename_lock, _forget_source_locked, filename, entry)


def _forget_source_locked(filename: str, entry: Any) -> None:
    if linecache.cache.get(filename) is entry:
        del linecache.cache[filename]


def runner_source(
    spec: RunnerSpec, compiled: Optional[Callable[..., Any]] = None
) -> tuple[str, dict[str, Any]]:
    """The runner's source text and the globals it needs."""
    writer = _RunnerWriter(spec, compiled)
    source = writer.write()
    lines = source.splitlines(True)
    if compiled is None:
        plain = [line.rstrip("\n") for line in lines]
        _declare_autocast_contexts(plain, writer, spec.graph)
        source = "\n".join(plain) + "\n"
    return source, writer.globals


def make_branch_runner(gm: fx.GraphModule, name: str) -> Callable[..., Any]:
    """A torch.cond branch graph (placeholders: operands, then lifted values; output:
    a flat tuple) as a generated function `branch(*operands) -> tuple`; a graph whose
    output is one value (a while_loop's cond graph) as a function giving that value."""
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    if not isinstance(output.args[0], (tuple, list)):
        copy = fx.Graph()
        value = copy.graph_copy(graph, {})
        copy.output((value,))
        wrapped = fx.GraphModule(gm, copy, class_name=type(gm).__name__)
        wrapped.meta.update(gm.meta)
        runner = make_branch_runner(wrapped, name)

        def single(*args: Any) -> Any:
            return runner(*args)[0]

        return single
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    count = len(cast(tuple, output.args[0]))
    attrs: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            value: Any = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            attrs[str(node.target)] = value
    spec = RunnerSpec(
        name=name,
        graph=graph,
        attr_values=attrs,
        slot_names=tuple(p.name for p in placeholders),
        root_slot=None,
        module_paths={},
        output=OutputLayout(
            pytree.tree_flatten(tuple(range(count)))[1],
            tuple(GraphOutput(i) for i in range(count)),
        ),
        entry_grad_mode=bool(gm.meta.get("nnscaler_entry_grad_mode", True)),
    )
    return make_runner(spec)


def replay_runner(spec: RunnerSpec, compiled: Any) -> Optional[Any]:
    """The runner of a graph replay (`_C.GraphReplay`, csrc/graph_replay.h) when the
    generated runner would only pass slots through: every graph input is an argument
    slot itself (not an item or attribute of one), the forward returns the graph's
    outputs as they are (one output, or a tuple of all of them in order), and nothing
    is written after the graph (module state, objects passed in).  The replay then
    takes the slots (and the training flags, which it ignores: they were folded) and
    the C hit path calls it with no Python frame of ours.  None otherwise."""
    if not isinstance(compiled, _C.GraphReplay) or compiled.single:
        return None
    layout = spec.output
    if spec.state_writes or layout.writes:
        return None
    slots: list[int] = []
    for node in spec.graph.nodes:
        if node.op != "placeholder":
            continue
        source = node.meta.get("nnscaler_input")
        if source is None or source.keys:
            return None
        slots.append(source.slot)
    outputs = len(compiled.outputs)
    if len(slots) != len(compiled.inputs) or len(layout.leaves) != outputs or any(
            leaf != GraphOutput(i) for i, leaf in enumerate(layout.leaves)):
        return None
    if layout.spec.is_leaf():
        single = True
    elif layout.spec.type is tuple and all(child.is_leaf() for child in layout.spec.children()):
        single = False
    else:
        return None
    return compiled.for_slots(tuple(slots), len(spec.slot_names) + len(spec.flag_names), single)


def make_runner(
    spec: RunnerSpec, compiled: Optional[Callable[..., Any]] = None
) -> Callable[..., Any]:
    """Compile the runner for `spec` (see module docstring)."""
    replay = replay_runner(spec, compiled)
    if replay is not None:
        return replay
    source, namespace = runner_source(spec, compiled)
    filename, entry = _register_source(spec.name, source)
    namespace["__name__"] = "nnscaler_eval.generated"
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
    runner = namespace["forward"]
    runner.__qualname__ = spec.name
    # The source stays visible for as long as the runner exists.
    weakref.finalize(runner, _forget_source, filename, entry)
    return runner
