"""Output shapes that depend on tensor values (capture/data_dependence.py): torch's
operator tags and fake tensors decide which calls make them, not a list of ours.

Every case is differential against eager over calls whose *data* changes the shape,
after a warm call with the same data (the case a baked-in shape gets wrong silently).
A shape Python reads from such a tensor makes the frame run eagerly (with the op named
in the reason); where Python reads no shape, the graph computes it on every hit.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import nnscaler
from oracle import agree, twins

L = lambda *values: torch.tensor(values)  # noqa: E731


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 3, batch_first=True)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        return out


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _sized(t):
    """A use of t's size that changes the answer when the size changes."""
    return t.float().sum() + t.shape[0] * 1000


def _coalesced(i, v):
    return _sized(torch.sparse_coo_tensor(i, v, (4, 4)).coalesce().values())


X = torch.randn(3, 6, 4)
LOG_PROBS = torch.randn(8, 2, 5).log_softmax(2)
TARGETS = torch.randint(1, 5, (2, 4))
I1 = torch.tensor([[0, 1, 1, 1], [2, 0, 2, 2]])
I2 = torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]])

# name -> (module, calls, the aten ops it exercises).  Each call list starts with the
# same data twice (a capture, then a warm call) before the data changes the shape.
CASES = {
    "packed_lstm": (PackedLSTM(), [(X, L(6, 4, 2)), (X, L(6, 4, 2)), (X, L(5, 5, 1)),
                                   (X, L(4, 4, 1))], {"_pack_padded_sequence"}),
    "repeat_interleave": (Fn(lambda c: _sized(torch.repeat_interleave(c))),
                          [(L(1, 2, 3),), (L(1, 2, 3),), (L(1, 0, 0),), (L(4, 4, 1),)],
                          {"repeat_interleave.Tensor"}),
    "repeat_interleave_dim": (Fn(lambda x, c: _sized(x.repeat_interleave(c, dim=0))),
                              [(X, L(1, 2, 3)), (X, L(1, 2, 3)), (X, L(0, 0, 1))],
                              {"repeat_interleave.Tensor"}),
    "tensor_split": (Fn(lambda x, cu: [_sized(p) for p in x.tensor_split(cu[1:-1])]),
                     [(torch.randn(9, 2), L(0, 2, 5, 9))] * 2 + [(torch.randn(9, 2), L(0, 4, 7, 9))],
                     set()),
    "sparse_coalesce": (Fn(_coalesced), [(I1, torch.ones(4))] * 2 + [(I2, torch.ones(4))],
                        set()),
    "arange_of_max": (Fn(lambda x, n: x[:, :torch.arange(n.max()).shape[0]] * 2),
                      [(X, L(6, 4, 2))] * 2 + [(X, L(5, 5, 1)), (X, L(4, 1, 1))], set()),
    "nonzero": (Fn(lambda x: _sized(x.nonzero())),
                [(L(0, 1, 1, 0),)] * 2 + [(L(1, 1, 1, 1),), (L(0, 0, 0, 0),)],
                {"nonzero"}),
    "where_one_arg": (Fn(lambda x: _sized(torch.where(x > 0)[0])),
                      [(L(0, 1, 1, 0),)] * 2 + [(L(1, 1, 1, 0),)], {"nonzero"}),
    "argwhere": (Fn(lambda x: _sized(torch.argwhere(x))),
                 [(L(0, 1, 1, 0),)] * 2 + [(L(1, 1, 1, 0),)], {"argwhere", "nonzero"}),
    "masked_select": (Fn(lambda x: _sized(x.masked_select(x > 0))),
                      [(L(-1., 2., 3.),)] * 2 + [(L(1., 2., 3.),)], {"masked_select"}),
    "bool_mask_index": (Fn(lambda x, m: _sized(x[m])),
                        [(torch.randn(4, 2), L(True, False, True, False))] * 2
                        + [(torch.randn(4, 2), L(True, True, True, False))], {"index.Tensor"}),
    "unique": (Fn(lambda x: _sized(torch.unique(x))),
               [(L(1, 1, 2),)] * 2 + [(L(1, 2, 3),)], {"_unique2"}),
    "unique_sorted_false": (Fn(lambda x: _sized(torch._unique(x, sorted=False)[0])),
                            [(L(1, 1, 2),)] * 2 + [(L(1, 2, 3),)], {"_unique"}),
    "unique_dim": (Fn(lambda x: _sized(torch.unique(x, dim=0))),
                   [(L([1, 1], [1, 1]),)] * 2 + [(L([1, 1], [2, 2]),)], {"unique_dim"}),
    "unique_consecutive": (Fn(lambda x: _sized(torch.unique_consecutive(x))),
                           [(L(1, 1, 2),)] * 2 + [(L(1, 2, 1),)], {"unique_consecutive"}),
    "unique_consecutive_dim": (Fn(lambda x: _sized(torch.unique_consecutive(x, dim=0))),
                               [(L([1, 1], [1, 1]),)] * 2 + [(L([1, 1], [2, 2]),)],
                               {"unique_dim_consecutive"}),
    # The loss has one value per sequence; torch's fake kernel cannot say so without
    # data (its other output's length is the longest target): the frame runs eagerly.
    "ctc_loss": (Fn(lambda lp, tg, il, tl: _sized(F.ctc_loss(lp, tg, il, tl, reduction="none"))),
                 [(LOG_PROBS, TARGETS, L(8, 8), L(3, 2))] * 2
                 + [(LOG_PROBS, TARGETS, L(8, 8), L(4, 1))], {"_ctc_loss", "_ctc_loss.Tensor"}),
    # residuals are empty unless the system is overdetermined and of full rank
    "lstsq_residuals": (Fn(lambda a, b: _sized(torch.linalg.lstsq(a, b, driver="gelsd").residuals)),
                        [(torch.randn(5, 3), torch.randn(5, 2))] * 2
                        + [(torch.ones(5, 3), torch.randn(5, 2))], {"linalg_lstsq"}),
    "bincount": (Fn(lambda x: _sized(torch.bincount(x))),
                 [(L(0, 1, 1),)] * 2 + [(L(0, 5, 1),)], {"bincount"}),
    "one_hot": (Fn(lambda x: _sized(F.one_hot(x))),
                [(L(0, 1, 1),)] * 2 + [(L(0, 5, 1),)], {"one_hot"}),
    "split_count": (Fn(lambda x: torch.stack([p.sum() for p in x[x > 0].split(2)])),
                    [(L(1., -1., 2., 3.),)] * 2 + [(L(1., 1., 2., 3.),)], {"index.Tensor"}),
}


def _tagged_ops() -> set[str]:
    """Every aten op (not an out= variant) that torch tags as having an output shape
    that depends on data."""
    found = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        base, _, overload = name.partition(".")
        if namespace != "aten" or overload == "out":
            continue
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        if torch.Tag.dynamic_output_shape in op.tags:
            found.add(name)
    return found


def test_every_tagged_operator_of_this_torch_has_a_case():
    covered = set().union(*(ops for _, _, ops in CASES.values()))
    missing = _tagged_ops() - covered
    assert not missing, f"tagged dynamic_output_shape, no case here: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_shape_from_data_is_never_baked_in(name):
    module, calls, _ = CASES[name]
    compiled, eager = twins(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # sparse invariant checks
        for args in calls:
            agree(compiled, eager, *args, rtol=1e-5, atol=1e-6)
    # Either the frame ran eagerly, or its one graph computes the shapes from the data
    # on every call (a size read of such a tensor is a node: a packed LSTM's batch
    # sizes reach torch ops only), so that every later call, whatever its data, hit it.
    info = nnscaler.cache_info(compiled)
    assert info.fallbacks > 0 or (info.captures == 1 and info.hits == len(calls) - 1), info


def test_a_packed_lstm_is_one_graph_whose_sizes_follow_the_data():
    compiled, eager = twins(PackedLSTM())
    for lengths in (L(6, 4, 2), L(5, 5, 1), L(1, 1, 1), L(6, 6, 6), L(2, 4, 6)):
        agree(compiled, eager, X, lengths)
    info = nnscaler.cache_info(compiled)
    assert info.captures == 1 and info.fallbacks == 0 and info.hits == 4, info
    assert "_pack_padded_sequence" in str(nnscaler.explain(compiled, X, L(6, 4, 2)))


class NonzeroCount(nn.Module):
    def forward(self, x):
        return x * len(x.nonzero())   # the count of a data-dependent shape, in Python


def test_the_fallback_names_the_operator_and_the_line():
    compiled = nnscaler.compile(NonzeroCount())
    x = torch.tensor([0.0, 1.0, 2.0])
    compiled(x)
    text = str(nnscaler.explain(compiled, x))
    assert "nonzero" in text and "depends on tensor" in text
    assert "test_data_dependent_shapes.py" in text


# -- what stays one graph --------------------------------------------------------------

STATIC = {
    # index with integer indices: tagged, but its shape follows from the indices' shape
    "int_index": (Fn(lambda x, i: _sized(x[i])), [(torch.randn(5, 2), L(0, 3)),
                                                  (torch.randn(5, 2), L(4, 1))]),
    # a value read into a scalar that only fills the tensor
    "full_of_max": (Fn(lambda t: _sized(torch.full((3,), t.max()))), [(L(1, 2),), (L(7, 9),)]),
    "one_hot_classes": (Fn(lambda x: _sized(F.one_hot(x, 7))), [(L(0, 1),), (L(6, 2),)]),
    "type_as_expand_as": (Fn(lambda x, y: _sized(x.type_as(y).expand_as(y))),
                          [(torch.randn(1, 3), torch.randn(4, 3)),
                           (torch.randn(1, 3), torch.randn(4, 3))]),
    # data-dependent, but no shape read in Python: the graph computes it every call
    "nonzero_returned": (Fn(lambda x: x.nonzero() * 2), [(L(0, 1, 1),), (L(1, 1, 1),),
                                                         (L(0, 0, 0),)]),
    "mask_summed": (Fn(lambda x: x[x > 0].sum() + x.shape[0]), [(L(1., -2.),), (L(1., 2.),)]),
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_shapes_that_follow_from_shapes_stay_one_graph(name):
    module, calls = STATIC[name]
    compiled, eager = twins(module)
    agree(compiled, eager, *calls[0], expect="capture")
    for args in calls[1:]:
        agree(compiled, eager, *args, expect="hit")
    assert nnscaler.cache_info(compiled).fallbacks == 0


# -- the other ways in ----------------------------------------------------------------

class HookedNonzero(nn.Module):
    """A submodule with a hook runs for real as one node: the op it runs inside still
    marks what it returns."""

    def __init__(self):
        super().__init__()
        self.inner = Fn(lambda x: x.nonzero())
        self.inner.register_forward_hook(lambda m, i, o: None)

    def forward(self, x):
        return _sized(self.inner(x))


def test_an_opaque_module_that_makes_a_data_dependent_shape():
    compiled, eager = twins(HookedNonzero())
    for x in (L(0, 1, 1), L(0, 1, 1), L(1, 1, 1), L(0, 0, 0)):
        agree(compiled, eager, x)


class Dynamic(nn.Module):
    """Sizes vary too: the symbolic capture meets the data-dependent op on fakes."""

    def forward(self, x):
        picked = x[x > 0]
        return picked * 2, picked.shape[0] + x.shape[0]


def test_a_dynamic_capture_with_a_data_dependent_shape():
    compiled, eager = twins(Dynamic())
    torch.manual_seed(0)
    for n in (4, 4, 7, 9, 12, 9, 30):
        agree(compiled, eager, torch.randn(n))


def test_fake_runs_leave_stderr_quiet(capfd):
    """Asking fake tensors (an unsupported op among them) prints nothing."""
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    compiled, eager = twins(Fn(lambda x: x * 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(nested)
    for x in (L(0, 1), L(1, 1)):
        agree(compiled, eager, x)
    assert capfd.readouterr().err == ""
