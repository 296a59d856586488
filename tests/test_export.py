"""`nnscaler.export`: the captured GraphModule in nnScaler's form."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from nnscaler.runtime.function import ifexpr

THIS_FILE = __file__


def line_of(marker: str) -> int:
    with open(THIS_FILE) as source:
        for number, line in enumerate(source, start=1):
            if line.rstrip().endswith(f"# <{marker}>"):
                return number
    raise AssertionError(marker)


@nnscaler.register_op("?, ? -> ?", name="test_export_scaled_residual")
def scaled_residual(x, y):
    return x + 0.5 * y


class TransformerBlock(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, p: float = 0.25) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(p)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.p
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p if self.training else 0.0)  # <sdpa>
        a = a.transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(a))  # <dropout>
        return scaled_residual(x, self.mlp(self.norm2(x)))  # <op>


def call_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def placeholders(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def test_export_transformer_block_has_ifexpr_and_training_inputs():
    model = TransformerBlock().train()
    gm = nnscaler.export(model, torch.randn(2, 5, 16))
    assert isinstance(gm, fx.GraphModule)
    assert placeholders(gm) == ["x", "training", "drop_training"]
    ifexprs = [n for n in gm.graph.nodes if n.target is ifexpr]
    assert len(ifexprs) == 1 and ifexprs[0].args[0].name == "training"
    assert ifexpr.__module__ == "nnscaler.runtime.function"
    assert "nnscaler.runtime.function.ifexpr(training, 0.25, 0.0)" in gm.code
    # Parameters are the module's own (get_attr of the live submodules).
    assert gm.qkv.weight is model.qkv.weight


@pytest.mark.parametrize("mode", [True, False])
def test_exported_graph_equals_eager_in_both_modes(mode):
    model = TransformerBlock()
    x = torch.randn(2, 5, 16)
    gm = nnscaler.export(model.train(), x)  # exported once, in train mode
    model.train(mode)
    for seed in range(3):
        torch.manual_seed(seed)
        expected = model(x)
        torch.manual_seed(seed)
        got = gm(x, mode, mode)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_flags_default_to_the_mode_at_export():
    model = TransformerBlock().eval()
    x = torch.randn(2, 5, 16)
    gm = nnscaler.export(model, x)
    torch.testing.assert_close(gm(x), model(x))
    assert "training = False" in gm.code


def test_registered_op_is_one_node():
    gm = nnscaler.export(TransformerBlock(), torch.randn(2, 5, 16))
    ops = [n for n in call_nodes(gm) if hasattr(n.target, "__nnscaler_op__")]
    assert len(ops) == 1 and ops[0].target is scaled_residual
    assert ops[0].meta["source_loc"] == f"{THIS_FILE}:{line_of('op')}"
    # Its body (an add and a mul) is not in the graph.
    assert not any(n.target == "mul" or getattr(n.target, "__name__", "") == "mul"
                   for n in call_nodes(gm) if n.meta["source_loc"].endswith(f":{line_of('op')}"))


def test_every_call_node_carries_its_source_line():
    gm = nnscaler.export(TransformerBlock(), torch.randn(2, 5, 16))
    for node in call_nodes(gm):
        filename, _, lineno = node.meta["source_loc"].rpartition(":")
        assert filename == THIS_FILE, node
        assert f'File "{THIS_FILE}", line {lineno}' in node.meta["stack_trace"]
    by_name = {n.name: n.meta["source_loc"] for n in call_nodes(gm)}
    assert by_name["scaled_dot_product_attention"] == f"{THIS_FILE}:{line_of('sdpa')}"
    # nn.Dropout's own line is in torch: the node gets the user's line that called it.
    assert by_name["dropout"] == f"{THIS_FILE}:{line_of('dropout')}"


def test_generated_code_is_readable_python():
    gm = nnscaler.export(TransformerBlock(), torch.randn(2, 5, 16))
    code = gm.code
    compile(code, "<exported>", "exec")
    assert "def forward(self, x, training = True, drop_training = True):" in code
    assert "scaled_dot_product_attention = " in code and "layer_norm = " in code
    readable = gm.print_readable(print_output=False)
    assert f"File: {THIS_FILE}:{line_of('sdpa')}" in readable


def test_output_structure_is_kept():
    class Pair(nn.Module):
        def forward(self, x, *, scale=2.0):
            return {"double": x * scale, "parts": (x.sin(), x.cos())}

    x = torch.randn(3)
    gm = nnscaler.export(Pair(), x, scale=3.0)
    out = gm(x)
    assert set(out) == {"double", "parts"}
    torch.testing.assert_close(out["double"], x * 3.0)
    torch.testing.assert_close(out["parts"][1], x.cos())


def test_data_dependent_forward_raises_a_clear_error():
    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum().item() > 0:  # <data>
                return x * 2
            return x

    with pytest.raises(nnscaler.ExportError) as info:
        nnscaler.export(DataDependent(), torch.ones(3))
    message = str(info.value)
    assert "DataDependent.forward" in message and "data-dependent value" in message
    assert f"{THIS_FILE}:{line_of('data')}" in message
    assert info.value.fallback.lineno == line_of("data")


def test_an_if_on_a_tensor_is_exported_as_one_cond_node():
    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # <if>
                x = x * 2
            return x + 1

    from nnscaler_eval.export import export as export_own_form   # torch.cond kept
    gm = export_own_form(Branchy(), torch.ones(3))
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.cond]
    assert node.meta["source_loc"] == f"{THIS_FILE}:{line_of('if')}"
    for x in (torch.ones(3), -torch.ones(3)):
        torch.testing.assert_close(gm(x), Branchy()(x))


def test_export_with_torch_cond():
    class WithCond(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda a: self.lin(a), lambda a: a * 2, (x,))

    model = WithCond()
    gm = nnscaler.export(model, torch.rand(2, 4))
    assert "torch.ops.higher_order.cond(" in gm.code
    for x in (torch.rand(2, 4), -torch.rand(2, 4)):
        torch.testing.assert_close(gm(x), model.lin(x) if x.sum() > 0 else x * 2)


def test_branching_on_training_warns_and_specialises():
    class Branches(nn.Module):
        def forward(self, x):
            if self.training:
                return x * 2
            return x

    with pytest.warns(UserWarning, match="branches on `training`"):
        gm = nnscaler.export(Branches().eval(), torch.ones(2))
    torch.testing.assert_close(gm(torch.ones(2)), torch.ones(2))


def test_export_leaves_the_module_as_it_was():
    model = TransformerBlock().train()
    nnscaler.export(model, torch.randn(2, 5, 16))
    assert all(type(m.__dict__["training"]) is bool for m in model.modules())
    assert nnscaler.cache_info(model).captures == 0


class CountsExports(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls = self.calls + 1
        return self.proj(x)


def test_export_says_which_state_writes_the_graph_leaves_out():
    model = CountsExports()
    x = torch.randn(2, 4)
    with pytest.warns(RuntimeWarning, match=r"CountsExports.calls = 1"):
        gm = nnscaler.export(model, x)
    torch.testing.assert_close(gm(x), model.proj(x))
