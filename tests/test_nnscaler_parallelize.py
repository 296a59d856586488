"""nnscaler-eval as the front end of the real Microsoft nnScaler (v0.8, from ../shared/peers).

Runs in the environment `make test-nnscaler` builds (.venv-nnscaler: torch 2.13 with
nnScaler installed `--no-deps` and nnscaler-eval beside it). Every model goes through
the real `nnscaler.parallelize(..., 'dp', ComputeConfig(1, 1))` with our capture as its
graph front end (`nnscaler_eval.parallelize.parallelize`), the generated module is
loaded on CPU (one gloo rank, nnScaler's own test helpers for the device), and its
outputs and gradients are compared with eager in train and in eval mode.
"""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
THIS_FILE = __file__


from nnscaler_peer import cpu_rank, require_nnscaler  # noqa: E402

require_nnscaler()

import nnscaler  # noqa: E402  (nnScaler's package, extended with our names)
from nnscaler import ComputeConfig  # noqa: E402
from nnscaler.graph.parser import FxModuleParser  # noqa: E402
from nnscaler.graph.parser.register import CustomizedOps  # noqa: E402

import nnscaler_eval  # noqa: E402
import nnscaler_eval.register_op  # noqa: E402
from nnscaler_eval.export import export as export_own_form  # noqa: E402
from nnscaler_eval.parallelize import export_for_nnscaler, parallelize  # noqa: E402

def line_of(marker: str) -> int:
    with open(THIS_FILE) as source:
        for number, line in enumerate(source, start=1):
            if line.rstrip().endswith(f"# <{marker}>"):
                return number
    raise AssertionError(marker)


# -- ops registered through both front doors -------------------------------------------

@nnscaler_eval.register_op.register_op("* k+, n k+ -> * n")  # ours: nnScaler's, adopted by ours
def our_linear_op(x, w):
    return torch.matmul(x, w.transpose(0, 1))


@nnscaler.graph.parser.register("a b, b -> a b")  # nnScaler's own entry point
def their_scale_op(x, s):
    return x * s


# -- models ----------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, d=8, h=16, p=0.3):
        super().__init__()
        self.fc1, self.fc2, self.p = nn.Linear(d, h), nn.Linear(h, 4), p

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = F.dropout(h, self.p if self.training else 0.0)  # <mlp-ifexpr>
        return self.fc2(h)


class ExplicitIfexpr(nn.Module):
    """nnScaler's own spelling: its ifexpr called explicitly, in both kinds."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        from nnscaler.runtime.function import ifexpr as nnscaler_ifexpr

        h = F.dropout(self.fc(x), nnscaler_ifexpr(self.training, 0.4, 0.0))
        return nnscaler_ifexpr(self.training, h * 2.0, h - 1.0)


class Block(nn.Module):
    """Pre-LN transformer block: attention dropout through a value ifexpr, residual
    dropout through nn.Dropout (its own flag), and a tensor-valued ifexpr."""

    def __init__(self, d=16, heads=2, p=0.2):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.drop = nn.Dropout(p)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        a = a.transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(a))
        h = self.mlp(self.ln2(x))
        h = h * 0.5 if self.training else h - 1.0  # <tensor-ifexpr>
        return x + h


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("gain", torch.tensor([1.5, 0.5, 1.0, 2.0]), persistent=False)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return y * self.gain.view(1, -1, 1, 1)


class DictInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(6, 5)

    def forward(self, batch, scale: float = 1.0):
        return (self.a(batch["x"]) * scale + self.b(batch["y"])).relu()


class RegisteredOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, 6) / 3)
        self.s = nn.Parameter(torch.rand(7) + 0.5)

    def forward(self, x):
        return their_scale_op(our_linear_op(x, self.w), self.s)


class GPT(nn.Module):
    def __init__(self, vocab=32, d=16, n_layer=2, block=8, p=0.1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, 2, p) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.register_buffer("positions", torch.arange(block), persistent=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(self.positions[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _inputs(name):
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        return MLP(), {"x": torch.randn(4, 8, generator=g)}
    if name == "block":
        return Block(), {"x": torch.randn(2, 5, 16, generator=g)}
    if name == "explicit":
        return ExplicitIfexpr(), {"x": torch.randn(3, 8, generator=g)}
    if name == "batchnorm":
        return BatchNormNet(), {"x": torch.randn(2, 3, 5, 5, generator=g)}
    if name == "dict":
        return DictInput(), {"batch": {"x": torch.randn(3, 6, generator=g),
                                       "y": torch.randn(3, 6, generator=g)}, "scale": 0.5}
    if name == "registered":
        return RegisteredOps(), {"x": torch.randn(3, 6, generator=g)}
    if name == "gpt":
        return GPT(), {"idx": torch.randint(0, 32, (2, 8), generator=g),
                       "targets": torch.randint(0, 32, (2, 8), generator=g)}
    raise KeyError(name)


# -- running the generated module on CPU -----------------------------------------------

@pytest.fixture(scope="module")
def cpu_nnscaler():
    """One gloo rank and nnScaler's CPU device helpers, for the whole module."""
    with cpu_rank():
        yield


def _leaves(value):
    return [v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _loss(out):
    return sum((t.float() * (i + 1)).sum() for i, t in enumerate(_leaves(out)))


def _fresh(inputs):
    return torch.utils._pytree.tree_map(
        lambda v: v.detach().clone().requires_grad_(v.is_floating_point())
        if isinstance(v, torch.Tensor) else v, inputs)


def _grads_by_original_name(pm):
    grads = {}
    for attr, meta in pm.fullmap.items():
        if meta.is_param:
            grad = getattr(pm, attr).grad
            grads[meta.orig_name] = None if grad is None else grad.detach().clone()
    return grads


MAX_DIFF: dict[tuple[str, str, str], float] = {}


@pytest.mark.parametrize("name", ["mlp", "block", "explicit", "batchnorm", "dict", "registered",
                                  "gpt"])
def test_parallelize_equals_eager_in_train_and_eval(name, cpu_nnscaler, tmp_path):
    torch.manual_seed(0)
    model, inputs = _inputs(name)
    eager = copy.deepcopy(model)
    # `nnscaler_eval.parallelize(...)` (the module is callable) and the function itself
    front_end = nnscaler_eval.parallelize if name == "mlp" else parallelize
    pm = front_end(model, _fresh(inputs), "dp", ComputeConfig(1, 1),
                   gen_savedir=str(tmp_path), load_module=True)
    assert isinstance(pm, nnscaler.ParallelModule)
    generated = "\n".join(p.read_text() for p in tmp_path.rglob("gencode*.py"))
    assert "segment" in generated
    for mode in (True, False, True):
        eager.train(mode)
        pm.train(mode)
        eager.zero_grad(set_to_none=True)
        pm.zero_grad()  # reducers' buffers (none with one rank): .grad too
        for param in pm.parameters():
            param.grad = None
        a_in, b_in = _fresh(inputs), _fresh(inputs)
        if "scale" in inputs:  # a float argument is an input, not the traced value
            a_in["scale"] = b_in["scale"] = 2.0 + mode
        torch.manual_seed(123)
        expected = eager(**a_in)
        torch.manual_seed(123)
        got = pm(**b_in)
        exp_leaves, got_leaves = _leaves(expected), _leaves(got)
        assert len(exp_leaves) == len(got_leaves)
        for e, g in zip(exp_leaves, got_leaves):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        _record(name, mode, "output", exp_leaves, got_leaves)
        if not any(t.requires_grad for t in exp_leaves):
            continue
        _loss(expected).backward()
        _loss(got).backward()
        pm.sync_grad()
        grads = _grads_by_original_name(pm)
        eager_grads = {n: p.grad for n, p in eager.named_parameters()}
        assert set(grads) == set(eager_grads), (set(grads) ^ set(eager_grads))
        for param_name, grad in grads.items():
            assert grad is not None and eager_grads[param_name] is not None, param_name
            torch.testing.assert_close(grad, eager_grads[param_name], rtol=1e-4, atol=1e-5)
        _record(name, mode, "grad", list(eager_grads.values()), [grads[n] for n in eager_grads])
        for key in ("x", "idx"):
            if key in a_in and a_in[key].grad is not None:
                torch.testing.assert_close(b_in[key].grad, a_in[key].grad, rtol=1e-4, atol=1e-5)
    # Buffers (BatchNorm running statistics) evolved the same way.
    for buf_name, buf in eager.state_dict().items():
        if "running" in buf_name or "num_batches" in buf_name:
            mapped = [getattr(pm, a) for a, m in pm.fullmap.items() if m.orig_name == buf_name]
            assert mapped, buf_name
            torch.testing.assert_close(mapped[0], buf)


def _record(name, mode, kind, expected, got):
    diff = max((float((g.detach().float() - e.detach().float()).abs().max()) for e, g in zip(expected, got)
                if e is not None and g is not None and e.numel()), default=0.0)
    key = (name, "train" if mode else "eval", kind)
    MAX_DIFF[key] = max(MAX_DIFF.get(key, 0.0), diff)
    print(f"max abs diff {name} {key[1]} {kind}: {diff:.3g}")


# -- the exported graph itself ---------------------------------------------------------

def test_export_for_nnscaler_form():
    model = Block().train()
    x = torch.randn(2, 5, 16)
    gm = export_for_nnscaler(model, x)
    nodes = list(gm.graph.nodes)
    assert [n.target for n in nodes if n.op == "placeholder"] == ["x"]
    flags = sorted(n.target for n in nodes if n.op == "get_attr" and n.target.endswith("training"))
    assert flags == ["drop.training", "training"]
    from nnscaler.runtime.function.function import ifexpr as their_ifexpr
    ifexprs = [n for n in nodes if n.op == "call_function" and n.target is their_ifexpr]
    assert len(ifexprs) == 2
    assert FxModuleParser._get_qualified_name(their_ifexpr) == "nnscaler.runtime.function.ifexpr" \
        or "ifexpr" in FxModuleParser._get_qualified_name(their_ifexpr)
    for node in nodes:
        assert "tensor_meta" in node.meta and "type" in node.meta and "op_context" in node.meta, node
    tensor_line = line_of("tensor-ifexpr")
    records = [n.meta["frame_record"] for n in nodes if "frame_record" in n.meta]
    assert any(r.filename == THIS_FILE and r.lineno == tensor_line for r in records)
    # layer_norm's weight and bias are positional, as nn.LayerNorm passes them.
    norms = [n for n in nodes if n.op == "call_function" and n.target is F.layer_norm]
    assert norms and all(not any(isinstance(v, torch.fx.Node) for v in n.kwargs.values())
                         for n in norms)
    inputs, ir_nodes, outputs = FxModuleParser.parse(gm, {"x": x}, save_content=False)
    assert len(inputs) == 1 and ir_nodes and outputs


def test_nnscalers_explicit_ifexpr_is_an_ifexpr_node(recwarn):
    from nnscaler.runtime.function.function import ifexpr as their_ifexpr

    gm = export_for_nnscaler(ExplicitIfexpr().train(), torch.randn(3, 8))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is their_ifexpr]
    assert len(nodes) == 2
    assert not [w for w in recwarn if "branches on `training`" in str(w.message)]
    assert their_ifexpr(True, 1, 2) == 1 and their_ifexpr(False, 1, 2) == 2


class BranchOnTraining(nn.Module):
    def forward(self, x):
        if self.training:
            return x * 2
        return x


def test_branching_on_training_warns():
    with pytest.warns(UserWarning, match="branches on `training`"):
        export_for_nnscaler(BranchOnTraining().train(), torch.randn(3))


class GradModes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            scale = self.lin(x).abs().mean()  # <no-grad>
        return self.lin(x) * scale  # <grad>


def test_op_context_follows_grad_mode():
    gm = export_for_nnscaler(GradModes(), torch.randn(2, 4))
    modes = {}
    for node in gm.graph.nodes:
        record = node.meta.get("frame_record")
        if record is not None and node.op in ("call_function", "call_method"):
            modes.setdefault(record.lineno, set()).add(
                node.meta["op_context"]["grad_mode"]["grad_mode"])
    assert modes[line_of("no-grad")] == {False}
    assert modes[line_of("grad")] == {True}


def test_dict_input_and_buffer_persistence():
    model = DictInput()
    inputs = _inputs("dict")[1]
    gm = export_for_nnscaler(model, **inputs)
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["batch", "scale"]
    getitems = [n for n in gm.graph.nodes if n.op == "call_function" and n.args
                and getattr(n.args[0], "target", None) == "batch"]
    assert sorted(n.args[1] for n in getitems) == ["x", "y"]
    bn_gm = export_for_nnscaler(BatchNormNet(), torch.randn(2, 3, 5, 5))
    assert "gain" in bn_gm._non_persistent_buffers_set
    assert "gain" not in bn_gm.state_dict()


def test_registered_ops_are_single_nodes_in_both_registries():
    assert CustomizedOps.exist(f"{__name__}.our_linear_op")
    assert CustomizedOps.exist(f"{__name__}.their_scale_op")
    # nnScaler's register_op returns the function itself; so does ours with nnScaler
    # (it is nnScaler's).
    assert our_linear_op.__name__ == "our_linear_op" and callable(our_linear_op)
    assert CustomizedOps.kOpRuntime[f"{__name__}.their_scale_op"] is their_scale_op
    model = RegisteredOps()
    x = torch.randn(3, 6)
    ours = export_own_form(model, x)
    targets = [n.target for n in ours.graph.nodes if n.op == "call_function"]
    assert len(targets) == 2, ours.code  # no t/matmul/mul traced through the ops
    theirs = export_for_nnscaler(model, x)
    targets = [n.target for n in theirs.graph.nodes if n.op == "call_function"]
    assert targets == [our_linear_op, their_scale_op]
    compiled = nnscaler.compile(RegisteredOps())
    compiled.load_state_dict(model.state_dict())
    torch.testing.assert_close(compiled(x), model(x))
    assert nnscaler.cache_info(compiled).captures == 1


class CondModel(nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda y: y + 1, lambda y: y - 1, (x,))  # <cond>


@pytest.mark.parametrize("export", [export_for_nnscaler, nnscaler.export],
                         ids=["export_for_nnscaler", "nnscaler.export"])
def test_cond_is_refused_with_the_users_line(export):
    with pytest.raises(nnscaler.ExportError) as info:
        export(CondModel(), torch.randn(3))
    assert "torch.cond" in str(info.value)
    assert f"{THIS_FILE}:{line_of('cond')}" in str(info.value)
    export_own_form(CondModel(), torch.randn(3))  # our own form keeps the cond node


def test_public_names_on_nnscalers_package():
    assert nnscaler.parallelize.__module__ == "nnscaler.parallel"
    assert nnscaler.__version__
    for name in ("compile", "export", "export_for_nnscaler", "explain", "cache_info", "reset"):
        assert getattr(nnscaler, name).__module__.startswith("nnscaler_eval"), name
    assert nnscaler.export is export_for_nnscaler  # nnScaler's package: nnScaler's form
    # nnScaler's own: installing us changes nothing of its contract
    assert nnscaler.register_op.__module__ == "nnscaler.graph.parser.register"
    from nnscaler.eval_frame import disable, enable
    assert callable(enable) and callable(disable)
    from nnscaler.runtime.function import ifexpr
    assert ifexpr(True, 1, 2) == 1 and ifexpr(False, 1, 2) == 2


def test_readme_example_runs(tmp_path):
    """The README's nnScaler example (ops.py + train.py) runs as written, on CPU."""
    import re
    import subprocess

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## With Microsoft nnScaler"):]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    assert blocks[0].startswith("# ops.py") and blocks[1].startswith("# train.py")
    (tmp_path / "ops.py").write_text(blocks[0])
    (tmp_path / "train.py").write_text(blocks[1])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["MASTER_PORT"] = "0"
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "def forward(self, batch, scale)" in done.stdout


def _profile_inputs(node):
    return [torch.randn(3, 6)]


@nnscaler.register_op("a b -> a b", name="tripled", code_impl_pattern="source",
                      input_gen_fn=_profile_inputs)
def tripled(x):
    return x * 3


@nnscaler.register_op(lambda *args, **kwargs: "a b -> a b")  # nnScaler's annotation function
def minus_one(x):
    return x - 1


class NnscalerSignatureOps(nn.Module):
    def forward(self, x):
        return minus_one(tripled(x))


def test_register_op_takes_nnscalers_signature():
    sig_tripled, sig_minus = f"{__name__}.tripled", f"{__name__}.minus_one"
    assert CustomizedOps.kOpCodeDef[sig_tripled].startswith("def tripled(x):")
    assert CustomizedOps.kOpInputGen[sig_tripled] is _profile_inputs
    assert CustomizedOps.kOpRuntime[sig_tripled] is tripled
    assert CustomizedOps.kOpRuntime[sig_minus] is minus_one
    # ours adopted it, under nnScaler's signature
    assert nnscaler.registered_ops()[sig_tripled].__wrapped__ is tripled.__wrapped__
    x = torch.randn(3, 6)
    ours = export_own_form(NnscalerSignatureOps(), x)
    # one opaque node each, whose target is the adopted op around the function's body
    assert [n.target.__wrapped__ for n in ours.graph.nodes if n.op == "call_function"] == \
        [tripled.__wrapped__, minus_one.__wrapped__]
    gm = export_for_nnscaler(NnscalerSignatureOps(), x)
    _, ir_nodes, _ = FxModuleParser.parse(gm, {"x": x}, save_content=False)
    assert [n.signature for n in ir_nodes] == [sig_tripled, sig_minus]
    torch.testing.assert_close(gm(x), x * 3 - 1)

