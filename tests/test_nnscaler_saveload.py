"""torch.save / torch.load of exported graphs keeps the graph: node meta, registered ops,
ifexpr nodes and buffer persistence (fx's own pickling re-traces the generated code and
loses them). Runs with and without Microsoft nnScaler installed."""
from __future__ import annotations

import importlib.util
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from nnscaler_eval.export import export as export_own_form  # nnscaler.export is nnScaler's
                                                            # form when nnScaler is installed

@nnscaler.register_op("* k+, n k+ -> * n", name="test_saveload_linear")
def saveload_linear(x, w):
    return torch.matmul(x, w.transpose(0, 1))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4))
        self.norm = nn.LayerNorm(5)
        self.register_buffer("offset", torch.tensor(0.25), persistent=False)
        self.register_buffer("kept", torch.tensor(2.0))

    def forward(self, x):
        h = self.norm(saveload_linear(x, self.w)) * self.kept + self.offset
        return F.dropout(h, 0.5 if self.training else 0.0)


def _round_trip(gm):
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _check(gm, loaded, x):
    assert [(n.op, n.name) for n in loaded.graph.nodes] == [(n.op, n.name) for n in gm.graph.nodes]
    for old, new in zip(gm.graph.nodes, loaded.graph.nodes):
        assert set(new.meta) == set(old.meta), (old, set(old.meta) ^ set(new.meta))
        assert new.meta.get("source_loc") == old.meta.get("source_loc")
    ops = [n for n in loaded.graph.nodes if n.op == "call_function"
           and getattr(n.target, "__name__", "") == "saveload_linear"]
    assert len(ops) == 1
    assert "offset" not in loaded.state_dict() and "kept" in loaded.state_dict()
    assert set(loaded.state_dict()) == set(gm.state_dict())


def test_export_round_trip():
    model = Net().eval()
    x = torch.randn(3, 4)
    gm = export_own_form(model, x)
    loaded = _round_trip(gm)
    _check(gm, loaded, x)
    assert any(n.target is nnscaler.runtime.function.ifexpr or
               getattr(n.target, "__name__", "") == "ifexpr" for n in loaded.graph.nodes)
    torch.testing.assert_close(loaded(x, training=False), model(x))


@pytest.mark.skipif(importlib.util.find_spec("nnscaler.graph") is None,
                    reason="export_for_nnscaler needs Microsoft nnScaler (make test-nnscaler)")
def test_export_for_nnscaler_round_trip():
    from nnscaler.graph.parser import FxModuleParser

    model = Net().eval()
    x = torch.randn(3, 4)
    gm = nnscaler.export_for_nnscaler(model, x)
    loaded = _round_trip(gm)
    _check(gm, loaded, x)
    for old, new in zip(gm.graph.nodes, loaded.graph.nodes):
        assert new.meta.get("tensor_meta") == old.meta.get("tensor_meta")
        assert new.meta.get("type") is old.meta.get("type")
    FxModuleParser.parse(loaded, {"x": x}, save_content=False)
