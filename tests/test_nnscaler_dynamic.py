"""export_for_nnscaler with dynamic dimensions, parsed by the real Microsoft nnScaler.

Apart from test_nnscaler_parallelize.py: that module's CPU fixture patches torch's
tensor constructors (nnScaler's `replace_all_device_with`) for all of its tests, and
a symbolic capture runs torch's meta functions, which call those constructors.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nnscaler_peer import require_nnscaler

require_nnscaler()

from nnscaler.graph.parser import FxModuleParser  # noqa: E402

from nnscaler_eval.export import ExportError  # noqa: E402
from nnscaler_eval.parallelize import export_for_nnscaler  # noqa: E402

class LengthVaries(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, 4, 4).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        return a.transpose(1, 2).reshape(B, L, 16)[:, : L // 2] * (L - 1), L * 2


def test_export_for_nnscaler_keeps_dynamic_dims_as_size_nodes():
    model = LengthVaries()
    x = torch.randn(2, 8, 16)
    gm = export_for_nnscaler(model, x, dynamic_dims={"x": 1})
    sizes = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "size"]
    assert sizes and sizes[0].args[1:] == (1,)
    views = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "view"]
    assert 8 not in views[0].args    # the length is the size node, not a constant
    for L in (3, 8, 13):
        x = torch.randn(2, L, 16)
        got, want = gm(x), model(x)
        assert torch.equal(got[0], want[0]) and got[1] == want[1] == 2 * L
    inputs, ir_nodes, outputs = FxModuleParser.parse(gm, {"x": x}, save_content=False)
    assert len(inputs) == 1 and ir_nodes and len(outputs[0]) == 2


def test_export_for_nnscaler_refuses_a_dynamic_dim_the_forward_fixes():
    class Fixes(nn.Module):
        def forward(self, x):
            return x.new_zeros(int(x.shape[1]))

    with pytest.raises(ExportError, match=r"x\.size\(1\).*test_nnscaler_dynamic.py:[0-9]+"):
        export_for_nnscaler(Fixes(), torch.randn(2, 8), dynamic_dims={"x": 1})
