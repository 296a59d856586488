"""What export_for_nnscaler keeps as graph values, checked where it matters: the module
nnScaler generates from our graph, called later with *other* values than the traced
ones, against eager.

nnScaler's generated module has no guards.  A value the trace baked in is a wrong
answer on its next call (`return out, y + 10` traced with y=1.0 returned 11.0 for every
y).  So every value that flows from an argument (numbers, a tensor's shape, a dict's
lookups, `Tensor.item()`) is a graph value, and the graph says grad mode and autocast
as nnScaler's code generator wants them (node metadata, not calls of ours).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn as nn

from nnscaler_peer import cpu_rank, require_nnscaler

require_nnscaler()

import pytest  # noqa: E402
import nnscaler  # noqa: E402
from nnscaler import ComputeConfig  # noqa: E402

from nnscaler_eval.parallelize import export_for_nnscaler, parallelize  # noqa: E402
from oracle import assert_same  # noqa: E402


@pytest.fixture(scope="module")
def cpu_nnscaler():
    with cpu_rank():
        yield


def _generated(model, inputs, tmp_path):
    """nnScaler's module for `model`, traced on `inputs` through our front end."""
    return parallelize(model, inputs, "dp", ComputeConfig(1, 1), gen_savedir=str(tmp_path),
                       load_module=True)


class TupleReturn(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 5)

    def forward(self, x, y):
        return self.linear(x) + y, y + 10


class IntKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 5)

    def forward(self, x, m=1, scale: float = 2.0):
        return self.linear(x) * scale + m * 3 - (m // 2)


class SizesFromShape(nn.Module):
    def forward(self, batched_data):
        data_x = batched_data["x"]
        n_graph, n_node = data_x.size()[:2]
        mask = data_x[:, :, 0].eq(0)
        cls = torch.zeros(n_graph, 1, dtype=mask.dtype)
        return torch.cat((cls, mask), dim=1), n_node * 2


class DictGet(nn.Module):
    def forward(self, batch: dict):
        return batch["x"] + batch.get("y", batch["z"]) * batch.get("scale", 1.0)


class DictViews(nn.Module):
    def forward(self, batch: dict):
        key = list(batch.keys())[0]
        return batch[key] + list(batch.values())[0] * list(batch.items())[0][1].sum()


class MathOfAnInput(nn.Module):
    def forward(self, x, y):
        return x * math.exp(-y) + math.sqrt(abs(y)) + math.floor(y / 2)


class WritesIntoSlices(nn.Module):
    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        z = x.new_empty(x.size(0), 6)
        z[:, :3] = self.left(x)
        z[:, 3:] = self.right(x)
        return z.sum(dim=1)


class Item(nn.Module):
    def forward(self, a, b):
        return b * a.item(), a.item() + 1


class NoGradAutocast(nn.Module):
    def __init__(self, autocast: bool = True):
        super().__init__()
        self.w = nn.Parameter(torch.rand(8, 8))
        self.autocast = autocast

    def forward(self, x):
        r1 = x @ self.w
        with torch.no_grad():
            r2 = r1 @ self.w
            with torch.enable_grad():
                r3 = r1 @ self.w
            with torch.autocast("cpu", enabled=self.autocast):
                r4 = (r2 * r3) @ self.w
        return (r1 * r2 * r3 * r4.float()).sum()


class Kwargs(nn.Module):
    """nnScaler keeps `**kwargs` as it is and documents what a forward reads from it
    as undefined: its values are the traced ones, as with nnScaler's own tracer (its
    conv tests read `groups` from there, with the same value in every call)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 5)

    def forward(self, x, **kwargs):
        return self.linear(x).data * kwargs.get("scale", 1.0) + kwargs["shift"]


class ReturnsShape(nn.Module):
    def forward(self, x):
        return x * 2, x.shape


class Settings:
    def __init__(self, scale: float, shift: int) -> None:
        self.scale, self.shift = scale, shift


class ReadsAnObject(nn.Module):
    def forward(self, x, settings):
        return x * getattr(settings, "scale") + settings.shift


# (model, traced inputs, later inputs: other values of the same shapes and types)
CASES = {
    "tuple_return": (TupleReturn, {"x": torch.randn(2, 3), "y": 1.0},
                     [{"x": torch.randn(2, 3), "y": 2.5}, {"x": torch.randn(2, 3), "y": -1.0}]),
    "int_keyword": (IntKeyword, {"x": torch.randn(2, 3), "m": 0, "scale": 2.0},
                    [{"x": torch.randn(2, 3), "m": 5, "scale": 0.5}]),
    "sizes": (SizesFromShape, {"batched_data": {"x": torch.tensor([[[1.0], [0.0], [3.0]]])}},
              [{"batched_data": {"x": torch.tensor([[[0.0], [2.0], [0.0]]])}}]),
    "dict_get": (DictGet, {"batch": {"x": torch.ones(3), "z": torch.full((3,), 2.0)}},
                 [{"batch": {"x": torch.ones(3), "y": torch.full((3,), 5.0),
                             "z": torch.full((3,), 2.0), "scale": 3.0}}]),
    "dict_views": (DictViews, {"batch": {"a": torch.ones(3)}},
                   [{"batch": {"a": torch.randn(3)}}]),
    "setitem": (WritesIntoSlices, {"x": torch.randn(2, 3)}, [{"x": torch.randn(2, 3)}]),
    "item": (Item, {"a": torch.tensor([5.0]), "b": torch.randn(3)},
             [{"a": torch.tensor([-2.0]), "b": torch.randn(3)}]),
    "kwargs": (Kwargs, {"x": torch.randn(2, 3), "scale": 2.0, "shift": 1},
               [{"x": torch.randn(2, 3), "scale": 2.0, "shift": 1}]),
    "returns_shape": (ReturnsShape, {"x": torch.randn(2, 3)}, []),
    "object": (ReadsAnObject, {"x": torch.randn(3), "settings": Settings(2.0, 1)},
               [{"x": torch.randn(3), "settings": Settings(-0.5, 7)}]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_generated_module_computes_values_from_its_inputs(name, cpu_nnscaler, tmp_path):
    make, traced, later = CASES[name]
    model = make()
    generated = _generated(model, traced, tmp_path)
    for inputs in [traced, *later]:
        assert_same(generated(**inputs), model(**inputs), rtol=1e-5, atol=1e-6)


def test_no_grad_and_autocast_blocks_become_nnscalers_context(cpu_nnscaler, tmp_path):
    """The graph says each node's grad mode and autocast state in its `op_context`
    metadata (nnScaler generates the `with` blocks from it); no calls of ours remain.
    (nnScaler's code generator writes CUDA autocast only, so the numbers are compared
    with CPU autocast off.)"""
    torch.manual_seed(0)
    x = torch.rand(4, 8)
    gm = export_for_nnscaler(NoGradAutocast(), x)
    assert "set_grad_enabled" not in gm.code and "autocast" not in gm.code, gm.code
    contexts = [n.meta["op_context"] for n in gm.graph.nodes if n.op != "placeholder"
                and "op_context" in n.meta]
    assert {c["grad_mode"]["grad_mode"] for c in contexts} == {True, False}
    assert any(c["autocast_info"]["cpu_enabled"] for c in contexts)
    model = NoGradAutocast(autocast=False)
    generated = _generated(model, {"x": x}, tmp_path)
    source = "\n".join(p.read_text() for p in tmp_path.rglob("gencode*.py"))
    assert "torch.no_grad()" in source, source
    for _ in range(2):
        x = torch.rand(4, 8, requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        got, want = generated(x), model(x2)
        torch.testing.assert_close(got, want)
        got.backward()
        want.backward()
        torch.testing.assert_close(x.grad, x2.grad)


def test_the_graph_records_python_values():
    gm = export_for_nnscaler(TupleReturn(), torch.randn(2, 3), 1.0)
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["x", "y"]
    assert "add_1 = y + 10" in gm.code, gm.code
    gm = export_for_nnscaler(DictGet(), {"x": torch.ones(3), "z": torch.ones(3)})
    assert ".get('y', " in gm.code and ".get('scale', 1.0)" in gm.code, gm.code
    gm = export_for_nnscaler(Item(), torch.tensor([5.0]), torch.randn(3))
    assert gm.code.count(".item()") == 2, gm.code
    gm = export_for_nnscaler(Kwargs(), torch.randn(2, 3), scale=2.0, shift=1)
    assert "def forward(self, x, **kwargs)" in gm.code and "kwargs[" not in gm.code, gm.code
    assert ".data" in gm.code and "_get_data" not in gm.code, gm.code
    gm = export_for_nnscaler(ReturnsShape(), torch.randn(2, 3))
    assert "x.shape" in gm.code and "getitem" not in gm.code, gm.code
    # `math` of an input is a node, as nnScaler's tracer records it (its generated code
    # imports no `math` yet, so the graph is checked, not a generated module)
    gm = export_for_nnscaler(MathOfAnInput(), torch.randn(3), 2.0)
    targets = {n.target for n in gm.graph.nodes}
    assert {math.exp, math.sqrt, math.floor} <= targets, gm.code
    for y in (0.5, -3.0):
        x = torch.randn(3)
        assert_same(gm(x, y), MathOfAnInput()(x, y))
    assert type(math.exp) is type(len)   # math as it was


def test_an_object_passed_in_keeps_its_class():
    settings = Settings(2.0, 1)
    gm = export_for_nnscaler(ReadsAnObject(), torch.randn(3), settings)
    assert type(settings) is Settings
    assert gm.code.count("settings.") == 2 or "getattr" in gm.code, gm.code


def test_a_tensor_read_from_kwargs_is_refused_with_the_reason():
    class TensorInKwargs(nn.Module):
        def forward(self, x, **kwargs):
            return x + kwargs["bias"]

    with pytest.raises(Exception, match=r"reads a tensor from \*\*kwargs"):
        export_for_nnscaler(TensorInKwargs(), torch.ones(2), bias=torch.ones(2))


def test_args_with_values_are_refused_as_nnscaler_refuses_them():
    class Args(nn.Module):
        def forward(self, x, *args):
            return x + args[0]

    with pytest.raises(Exception, match=r"\*args"):
        export_for_nnscaler(Args(), torch.ones(2), torch.ones(2))


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        return x * s

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


class UsesAutogradFunction(nn.Module):
    def forward(self, x):
        return _Scale.apply(x, 3.0) + 1


def test_an_autograd_function_is_its_class_apply_for_nnscaler():
    """nnScaler knows a custom autograd op by `Cls.apply`, bound to its class (it then
    reports it as unregistered, or runs the op registered for it)."""
    from nnscaler.graph.parser.parser import FxModuleParser

    gm = export_for_nnscaler(UsesAutogradFunction(), torch.randn(3))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert any(getattr(t, "__self__", None) is _Scale and t.__name__ == "apply"
               for t in targets), targets
    _, ir_nodes, _ = FxModuleParser.parse(gm, {"x": torch.randn(3)}, save_content=False)
    assert any("_Scale.apply" in str(getattr(n, "signature", "")) for n in ir_nodes)


class MovesToDevice(nn.Module):
    def forward(self, x):
        return (x.to("cuda") + torch.ones(3, device="cuda")) * 2


def test_a_patched_tensor_method_is_recorded_by_its_name():
    """nnScaler's tests patch `torch.Tensor.to` (and constructors) to force CPU: the
    export records the API by the name it replaced, as nnScaler's tracer does, so the
    generated code calls whatever is bound there when it runs."""
    from nnscaler_peer import peer_test_utils

    with peer_test_utils().replace_all_device_with("cpu"):
        gm = export_for_nnscaler(MovesToDevice(), torch.randn(3))
        x = torch.randn(3)
        assert_same(gm(x), (x + 1) * 2)
    assert ".to(" in gm.code, gm.code


def test_named_tuple_and_structseq_outputs():
    import collections

    Pair = collections.namedtuple("Pair", "doubled bumped")

    class NamedOut(nn.Module):
        def forward(self, x):
            return Pair(x * 2, x + 1)

    class MaxOut(nn.Module):
        def forward(self, x):
            return x.max(dim=0)

    x = torch.randn(3, 2)
    gm = export_for_nnscaler(NamedOut(), x)
    assert_same(tuple(gm(x)), (x * 2, x + 1))
    gm = export_for_nnscaler(MaxOut(), x)
    assert_same(tuple(gm(x)), tuple(x.max(dim=0)))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class CallsForwardDirectly(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = _Encoder()

    def forward(self, x):
        return self.encoder.forward(x).sum()


def test_each_node_says_its_module_scope_as_nnscaler_tracer_does():
    """`nn_module_stack`: the submodules whose forward made the node, outermost first,
    path -> class (autodist builds its scope tree from it); `.forward()` called
    directly counts like a call."""
    gm = export_for_nnscaler(CallsForwardDirectly(), torch.randn(2, 4))
    scopes = {n.name: n.meta.get("nn_module_stack") for n in gm.graph.nodes
              if n.op in ("call_function", "call_method")}
    assert all(scope is not None for scope in scopes.values()), scopes
    deepest = [list(s.items()) for s in scopes.values() if len(s) == 3]
    assert deepest and all(
        [p for p, _ in s] in (["encoder", "encoder.layers.0", "encoder.layers.0.fc"],
                              ["encoder", "encoder.layers.1", "encoder.layers.1.fc"])
        and [c for _, c in s] == [_Encoder, _Layer, nn.Linear] for s in deepest), deepest
    assert any(not s for s in scopes.values())  # the sum, at the root


@nnscaler.register_op("n -> n, n, ?")
def _split_with_sign(x):
    return x * 2, x + 1, 1 if float(x.sum()) > 0 else -1


@nnscaler.register_op("n -> ?, ?")
def _two_numbers_in_a_list(x, factor=1):
    return [factor, factor * 2]


class UsesOpNumbers(nn.Module):
    def forward(self, x):
        doubled, _, sign = _split_with_sign(x)
        return doubled * sign + 1


class ReturnsOpList(nn.Module):
    def forward(self, x):
        return _two_numbers_in_a_list(x, factor=4)


def test_values_an_op_returns_are_its_outputs(cpu_nnscaler, tmp_path):
    """A registered op's number outputs are graph values (not this trace's constants),
    a list it returns is one value (as nnScaler's tracer keeps it), and an item read
    nobody uses adds no operator."""
    model = UsesOpNumbers()
    gm = export_for_nnscaler(model, torch.ones(3))
    getitems = [n.args[1] for n in gm.graph.nodes if n.target is operator.getitem
                and n.args[0].target is _split_with_sign]
    assert sorted(getitems) == [0, 2], gm.code   # not the unused item 1
    generated = _generated(model, {"x": torch.ones(3)}, tmp_path)
    for x in (torch.ones(3), -torch.ones(3), torch.randn(3)):
        assert_same(generated(x), model(x))
    gm = export_for_nnscaler(ReturnsOpList(), torch.ones(3))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert getattr(output.args[0], "target", None) is _two_numbers_in_a_list, gm.code


class FoldsConstants(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, a):
        n = a.shape[0]
        with nnscaler.constant_folding():
            b = self.fc(a) + nnscaler.fold_constant(n)
            m = b.shape[0]
        return b * m + n


def test_constant_folding_blocks_and_fold_constant_as_nnscaler_traces_them():
    """`with nnscaler.constant_folding():` is in each node's op context (nnScaler's parser
    folds by it) and `fold_constant` is a node of its own, as nnScaler's tracer keeps it."""
    from nnscaler.runtime.function import fold_constant

    gm = export_for_nnscaler(FoldsConstants(), torch.randn(2, 3))
    nodes = {n.name: n for n in gm.graph.nodes}
    assert any(n.target is fold_constant for n in nodes.values()), gm.code
    folding = {n.name: n.meta["op_context"]["constant_folding"] for n in nodes.values()
               if "op_context" in n.meta and n.op in ("call_function", "call_method")}
    assert folding["linear"] is True and folding["fold_constant"] is True, folding
    assert folding["mul"] is None and folding["add_1"] is None, folding
    assert fold_constant(5) == 5   # outside a trace: its own body
