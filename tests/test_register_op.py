"""register_op: the annotation grammar, registration, and one opaque node per call."""
from __future__ import annotations

import functools
import pickle

import pytest
import torch
import torch.nn.functional as F

from nnscaler_eval.register_op import (
    AnnotationError,
    Dim,
    DimGroup,
    OpAnnotation,
    TensorAnno,
    parse_annotation,
    register_op,
    registered_ops,
)
from nnscaler_eval.tracing.trace_state import current_tracer, set_current_tracer


def T(*dims):
    return TensorAnno(tuple(dims))


def d(name, marker=""):
    return Dim(name, reduce=marker == "+", frozen=marker == "^")


UNKNOWN = TensorAnno(None)
FIXED_1 = Dim("1", reduce=False, frozen=True)


# ------------------------------------------------------------------ accepted

ACCEPTED = [
    ("* k+, n k+ -> * n",
     [T(..., d("k", "+")), T(d("n"), d("k", "+"))], [T(..., d("n"))]),
    ("b m k+, b k+ n -> b m n",
     [T(d("b"), d("m"), d("k", "+")), T(d("b"), d("k", "+"), d("n"))],
     [T(d("b"), d("m"), d("n"))]),
    ("(h^ m^) kd+, kd+ n -> h^ m^ n",
     [T(DimGroup((d("h", "^"), d("m", "^"))), d("kd", "+")), T(d("kd", "+"), d("n"))],
     [T(d("h", "^"), d("m", "^"), d("n"))]),
    ("?, ? -> ?", [UNKNOWN, UNKNOWN], [UNKNOWN]),
    ("a b, b c -> a c", [T(d("a"), d("b")), T(d("b"), d("c"))], [T(d("a"), d("c"))]),
    ("* -> *", [T(...)], [T(...)]),
    ("a 1 -> a", [T(d("a"), FIXED_1)], [T(d("a"))]),
    # beyond the brief's list: nnScaler's own documented forms
    ("4 k+, k+ d -> 8 d",
     [T(Dim("4", False, True), d("k", "+")), T(d("k", "+"), d("d"))],
     [T(Dim("8", False, True), d("d"))]),
    ("a (b c) -> (a b) c",
     [T(d("a"), DimGroup((d("b"), d("c"))))], [T(DimGroup((d("a"), d("b"))), d("c"))]),
    ("a b -> a b, ?", [T(d("a"), d("b"))], [T(d("a"), d("b")), UNKNOWN]),
    ("* d^, s -> * s", [T(..., d("d", "^")), T(d("s"))], [T(..., d("s"))]),
    ("a * b -> b * a", [T(d("a"), ..., d("b"))], [T(d("b"), ..., d("a"))]),
    ("(h 2) x_1 -> h x_1", [T(DimGroup((d("h"), Dim("2", False, True))), d("x_1"))],
     [T(d("h"), d("x_1"))]),
    ("  a\tb ,c->a  ", [T(d("a"), d("b")), T(d("c"))], [T(d("a"))]),
    ("( a  b^ ) -> a b^", [T(DimGroup((d("a"), d("b", "^"))))], [T(d("a"), d("b", "^"))]),
]


@pytest.mark.parametrize("text, inputs, outputs", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_accepted_annotation_structure(text, inputs, outputs):
    anno = parse_annotation(text)
    assert anno == OpAnnotation(tuple(inputs), tuple(outputs), text)
    assert anno.text == text
    # str() is a canonical form that parses back to the same structure
    assert parse_annotation(str(anno)) == anno


def test_structure_details():
    anno = parse_annotation("(h^ m^) kd+, kd+ n -> h^ m^ n")
    group, kd = anno.inputs[0].dims
    assert isinstance(group, DimGroup) and group.column == 0
    assert [(x.name, x.frozen, x.column) for x in group.dims] == [("h", True, 1), ("m", True, 4)]
    assert kd.reduce and not kd.frozen and kd.column == 8 and kd.size is None
    assert anno.arrow_column == 19
    assert [t.column for t in anno.inputs] == [0, 13]
    assert [x.name for x in anno.inputs[0].names()] == ["h", "m", "kd"]
    assert parse_annotation("a 1 -> a").inputs[0].dims[1].size == 1
    assert parse_annotation("?, ? -> ?").inputs[0].is_unknown
    assert str(parse_annotation("  (h^  m^)\tkd+ ,kd+ n->h^ m^ n")) == \
        "(h^ m^) kd+, kd+ n -> h^ m^ n"
    # equality is structural, text spacing aside; the ellipsis marker is `...`
    assert parse_annotation("*  ->  *") == parse_annotation("* -> *")
    assert parse_annotation("* -> *").inputs[0].dims == (...,)
    with pytest.raises(ValueError):
        Dim("k", reduce=True, frozen=True)


# ------------------------------------------------------------------ rejected

REJECTED = [
    # text, caret column, words the message must contain
    ("a b", 3, "missing '->'"),
    ("a, b", 4, "missing '->'"),
    ("a -> b -> c", 7, "a second '->'"),
    (", -> a", 0, "empty input annotation"),
    ("a, -> a", 3, "empty input annotation before '->'"),
    ("a -> a,", 7, "empty output annotation"),
    ("a ->", 4, "empty output annotation"),
    ("", 0, "empty annotation"),
    ("* * -> *", 2, "'*' appears twice in one tensor"),
    ("a * b * -> a", 6, "'*' appears twice"),
    ("k++ -> a", 2, "dimension 'k' has two markers ('+' then '+')"),
    ("k+^ -> a", 2, "dimension 'k' has two markers ('+' then '^')"),
    ("(a (b)) -> a", 3, "groups cannot be nested"),
    ("() -> a", 0, "empty group"),
    ("a () -> a", 2, "empty group"),
    ("(a b -> a", 0, "unclosed '('"),
    ("a) -> a", 1, "unmatched ')'"),
    ("? a -> a", 2, "'?' stands for a whole argument"),
    ("a ? -> a", 2, "'?' stands for a whole argument"),
    ("? ? -> a", 2, "'?' stands for a whole argument"),
    ("?+ -> a", 1, "'?' takes no marker '+'"),
    ("* k+, n k+ -> * q", 16, "dimension 'q' in the output is not defined by any input"),
    ("(h m) -> h q", 11, "dimension 'q' in the output is not defined"),
    ("a -> *", 5, "'*' in the output needs a '*' in some input"),
    ("a, ? -> a, a *", 13, "'*' in the output needs a '*'"),
    ("* k+ -> * k+", 11, "reduction dimension 'k+' in the output"),
    ("m k+, k+ n -> m n k", 18, "dimension 'k' in the output is a reduction dimension"),
    ("(h k+) -> h k", 12, "dimension 'k' in the output is a reduction dimension"),
    ("a^ b, a c -> b", 6, "dimension 'a' is unmarked (partitionable) here but marked '^'"),
    ("a+ b, a^ b -> b", 6, "marked '^' (not partitionable) here but marked '+'"),
    ("h^ -> h", 6, "dimension 'h' is unmarked (partitionable) here but marked '^'"),
    ("(h^ m) -> h^ m^", 13, "dimension 'm' is marked '^'"),
    ("1a -> a", 0, "'1a' is not a valid dimension"),
    ("a 12bc -> a", 2, "'12bc' is not a valid dimension"),
    ("a $ b -> a", 2, "unexpected character '$'"),
    ("a -> a.", 6, "unexpected character '.'"),
    ("a => a", 2, "unexpected character '='"),
    ("a - > a", 2, "stray '-'"),
    ("a > a", 2, "unexpected character '>'"),
    ("é -> é", 0, "unexpected character 'é'"),
    ("k + -> a", 2, "marker '+' must directly follow a dimension name"),
    ("^a -> a", 0, "marker '^' must directly follow a dimension name"),
    ("(a b)+ -> a", 5, "a group takes no marker '+'"),
    ("1^ -> 1", 1, "fixed-size dimension '1' takes no marker '^'"),
    ("*+ -> *", 1, "'*' takes no marker '+'"),
    ("a(b) -> a", 1, "dimensions must be separated by spaces"),
    ("(a)(b) -> a", 3, "dimensions must be separated by spaces"),
    ("a* -> a", 1, "dimensions must be separated by spaces"),
    ("(a *) -> a", 3, "'*' cannot appear inside a group"),
    ("(a ?) -> a", 3, "'?' cannot appear inside a group"),
]


def assert_caret(error: AnnotationError, text: str, column: int) -> None:
    assert error.column == column
    assert error.annotation == text
    lines = str(error).splitlines()
    assert lines[0].startswith("nnscaler.register_op: ")
    shown = "".join(" " if ch.isspace() else ch for ch in text)
    assert lines[1] == f"  '{shown}'"
    # the caret sits under the offending character of the quoted annotation
    assert lines[2] == " " * (3 + column) + "^"


@pytest.mark.parametrize("text, column, words", REJECTED, ids=[r[0] or "<empty>" for r in REJECTED])
def test_rejected_annotation(text, column, words):
    with pytest.raises(AnnotationError) as info:
        parse_annotation(text)
    assert words in info.value.reason
    assert_caret(info.value, text, column)


def test_error_message_layout_matches_the_documented_example():
    with pytest.raises(AnnotationError) as info:
        parse_annotation("* k+, n k+ -> * q")
    assert str(info.value) == (
        "nnscaler.register_op: dimension 'q' in the output is not defined by any input\n"
        "  '* k+, n k+ -> * q'\n"
        "                   ^")


def test_annotation_error_is_a_value_error_and_pickles():
    with pytest.raises(ValueError):
        parse_annotation("a -> b")
    try:
        parse_annotation("a -> b")
    except AnnotationError as error:
        copy = pickle.loads(pickle.dumps(error))
        assert (copy.reason, copy.annotation, copy.column) == \
            (error.reason, error.annotation, error.column)
        assert str(copy) == str(error)


def test_tabs_and_newlines_keep_the_caret_aligned():
    text = "a\tb ->\nq"
    with pytest.raises(AnnotationError) as info:
        parse_annotation(text)
    assert_caret(info.value, text, 7)


def test_conflict_message_points_back_at_the_first_use():
    with pytest.raises(AnnotationError) as info:
        parse_annotation("x k+, k n -> x n")
    assert "at column 2" in info.value.reason
    assert_caret(info.value, "x k+, k n -> x n", 6)


def test_non_str_annotation():
    with pytest.raises(TypeError, match="not int"):
        parse_annotation(3)


# ------------------------------------------------------------------ arity

def test_arity_too_many_annotations_points_at_the_first_extra_one():
    def add(x, y):
        return x + y

    text = "a, a, a -> a"
    with pytest.raises(AnnotationError) as info:
        register_op(text, name="arity_too_many")(add)
    assert "3 input annotations but" in info.value.reason
    assert "add(x, y) takes 2 positional parameters" in info.value.reason
    assert_caret(info.value, text, 6)
    assert "arity_too_many" not in registered_ops()


def test_arity_keyword_only_parameters_do_not_count():
    def scale(x, *, factor):
        return x * factor

    with pytest.raises(AnnotationError) as info:
        register_op(scale, "a, ? -> a", name="arity_kwonly")
    assert "takes 1 positional parameter" in info.value.reason
    assert_caret(info.value, "a, ? -> a", 3)


def test_arity_positional_only_without_default_needs_an_annotation():
    def pos_only(x, y, /):
        return x + y

    with pytest.raises(AnnotationError) as info:
        register_op(pos_only, "a -> a", name="arity_posonly")
    assert "positional-only parameter 'y'" in info.value.reason
    assert_caret(info.value, "a -> a", 2)  # at the '->'


def test_arity_allowed_shapes():
    # nnScaler's documented example: `h` is a keyword option that sizes the group
    def matmul_custom(x, w, h):
        out = torch.matmul(x, w)
        return out.view(h, out.size(0) // h, out.size(1))

    op = register_op("(h^ m^) kd+, kd+ n -> h^ m^ n", name="arity_matmul")(matmul_custom)
    x, w = torch.randn(6, 4), torch.randn(4, 5)
    torch.testing.assert_close(op(x, w, h=2), matmul_custom(x, w, h=2))

    def with_default(x, b=4):
        return x

    def varargs(*xs):
        return xs[0]

    def pos_only_default(x, y=1, /, *, z=2, **kw):
        return x

    register_op("a (b c) -> (a b) c", name="arity_default")(with_default)
    register_op("a, b -> a", name="arity_default_both")(with_default)
    register_op("a, b, c -> a", name="arity_varargs")(varargs)
    register_op("a -> a", name="arity_pos_only_default")(pos_only_default)
    # builtins without a readable signature are not checked
    register_op("a, ?, ?, ? -> a", name="arity_builtin")(torch.add)


def test_arity_methods_count_self():
    class Holder:
        @register_op("?, a -> a", name="arity_method")
        def method(self, x):
            return x * 2

    class Plain:
        def method(self, x):
            return x * 2

    assert Holder().method(3) == 6
    # a bound method's signature has no `self`
    with pytest.raises(AnnotationError, match="2 input annotations but"):
        register_op("a, a -> a", name="arity_bound")(Plain().method)
    assert register_op("a -> a", name="arity_bound")(Plain().method)(4) == 8


# ------------------------------------------------------------------ registration

def test_decorator_form_and_attributes():
    @register_op("a b, b c -> a c")
    def my_matmul(x, y):
        """Docs stay."""
        return x @ y

    assert my_matmul.op_name == my_matmul.__qualname__
    assert my_matmul.op_name.endswith("test_decorator_form_and_attributes.<locals>.my_matmul")
    assert my_matmul.__name__ == "my_matmul" and my_matmul.__doc__ == "Docs stay."
    assert my_matmul.__nnscaler_op__ == parse_annotation("a b, b c -> a c")
    inner = my_matmul.__wrapped__
    assert inner is not my_matmul and inner.__name__ == "my_matmul"
    assert registered_ops()[my_matmul.op_name] is my_matmul
    x, y = torch.randn(2, 3), torch.randn(3, 4)
    torch.testing.assert_close(my_matmul(x, y), x @ y)


def test_call_forms():
    def fn(x, w):
        return x @ w.t()

    op1 = register_op("* k+, n k+ -> * n", name="form_call")(fn)
    op2 = register_op("* k+, n k+ -> * n", "form_positional_name")(fn)
    op3 = register_op(fn, "* k+, n k+ -> * n", name="form_fn_first")
    op4 = register_op(fn, "* k+, n k+ -> * n", "form_fn_first_positional")
    op5 = register_op(annotation="* k+, n k+ -> * n", name="form_keywords")(fn)
    ops = registered_ops()
    for op, name in [(op1, "form_call"), (op2, "form_positional_name"), (op3, "form_fn_first"),
                     (op4, "form_fn_first_positional"), (op5, "form_keywords")]:
        assert op.op_name == name and ops[name] is op and op.__wrapped__ is fn
    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    torch.testing.assert_close(op3(x, w), fn(x, w))


def test_registered_ops_is_a_copy():
    snapshot = registered_ops()
    snapshot["not_really"] = None
    assert "not_really" not in registered_ops()


def test_usage_errors():
    def fn(x):
        return x

    with pytest.raises(TypeError, match="needs an annotation"):
        register_op(fn)
    with pytest.raises(TypeError, match="needs an annotation"):
        register_op()
    with pytest.raises(TypeError, match="annotation functions need Microsoft nnScaler"):
        register_op(fn, lambda *a, **k: "a -> a")
    with pytest.raises(TypeError, match="not int"):
        register_op(3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'code_impl_pattern'"):
        register_op("a -> a", code_impl_pattern="import")
    with pytest.raises(TypeError, match="multiple values for argument 'name'"):
        register_op(fn, "a -> a", "n1", name="n2")
    with pytest.raises(TypeError, match="non-empty str"):
        register_op("a -> a", name="")
    with pytest.raises(TypeError, match="an annotation and an optional name"):
        register_op("a -> a", "n", "extra")
    # a bad annotation fails at the decorator line, before any function is seen
    with pytest.raises(AnnotationError):
        register_op("a -> q")


def test_cannot_register_a_registered_op_or_a_module():
    @register_op("a -> a", name="reg_twice")
    def op(x):
        return x

    with pytest.raises(TypeError, match="already a registered op"):
        register_op("a -> a", name="reg_twice_again")(op)
    with pytest.raises(TypeError, match="nn.Module"):
        register_op("a -> a", name="reg_module")(torch.nn.ReLU())
    with pytest.raises(TypeError, match="nn.Module"):
        register_op("a -> a", name="reg_module_cls")(torch.nn.ReLU)


def test_partial_needs_a_name():
    def scale(x, factor):
        return x * factor

    with pytest.raises(TypeError, match="pass name="):
        register_op("a -> a")(functools.partial(scale, factor=2))
    op = register_op("a -> a", name="reg_partial")(functools.partial(scale, factor=2))
    assert op(3) == 6 and op.__name__ == "reg_partial"


def test_name_collision_names_both_functions():
    def first(x):
        return x

    def second(x):
        return x

    register_op("a -> a", name="collide")(first)
    with pytest.raises(ValueError) as info:
        register_op("a -> a", name="collide")(second)
    message = str(info.value)
    assert "'collide'" in message
    assert "test_name_collision_names_both_functions.<locals>.first" in message
    assert "test_name_collision_names_both_functions.<locals>.second" in message
    assert "test_register_op.py:" in message  # where each one is defined
    assert registered_ops()["collide"].__wrapped__ is first


def test_default_names_collide_across_modules():
    def get_value(x):
        return x

    def impostor(x):
        return x

    impostor.__qualname__ = "shared_qualname"
    impostor.__module__ = "some.other.module"
    get_value.__qualname__ = "shared_qualname"
    register_op("a -> a")(get_value)
    with pytest.raises(ValueError, match="some.other.module.shared_qualname"):
        register_op("a -> a")(impostor)


def test_registering_the_same_function_again():
    def same(x):
        return x

    op = register_op("a b -> a b", name="again")(same)
    assert register_op("a  b ->a b", name="again")(same) is op  # same structure
    with pytest.raises(ValueError, match="already registered as 'again'"):
        register_op("a b -> b a", name="again")(same)


def test_redefinition_replaces_but_lambdas_collide():
    def make(k):
        def redefined(x):
            return x * k
        return redefined

    op1 = register_op("a -> a", name="redefined")(make(2))
    op2 = register_op("a -> a", name="redefined")(make(3))
    assert registered_ops()["redefined"] is op2 and op1(1) == 2 and op2(1) == 3

    register_op("a -> a", name="lambda_op")(lambda x: x)
    with pytest.raises(ValueError, match="taken by"):
        register_op("a -> a", name="lambda_op")(lambda x: x)


# ------------------------------------------------------------------ calls

def test_runs_normally_outside_tracing():
    calls = []

    @register_op("* k+, n k+ -> * n", name="plain_linear")
    def plain_linear(x, w, bias=None):
        calls.append(1)
        out = x @ w.t()
        return out if bias is None else out + bias

    x, w, b = torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5)
    assert current_tracer() is None
    torch.testing.assert_close(plain_linear(x, w, bias=b), x @ w.t() + b)
    assert calls == [1]
    out = plain_linear(x.requires_grad_(), w)
    out.sum().backward()
    assert x.grad is not None


class FakeTracer:
    """Implements the capture tracer's contract: run fn for real, record one node."""

    def __init__(self, suspend_by_clearing=False):
        self.nodes = []
        self.suspend_by_clearing = suspend_by_clearing

    def call_opaque(self, fn, args, kwargs):
        previous = set_current_tracer(None) if self.suspend_by_clearing else None
        try:
            result = fn(*args, **kwargs)
        finally:
            if self.suspend_by_clearing:
                set_current_tracer(previous)
        self.nodes.append(("call_function", fn, args, kwargs))
        return result


def traced(tracer, body):
    previous = set_current_tracer(tracer)
    try:
        return body()
    finally:
        set_current_tracer(previous)


@pytest.mark.parametrize("suspend_by_clearing", [False, True])
def test_call_opaque_protocol(suspend_by_clearing):
    runs = []

    @register_op("a -> a", name=f"opaque_inner_{suspend_by_clearing}")
    def inner(x):
        runs.append("inner")
        return x + 1

    @register_op("a, ? -> a", name=f"opaque_outer_{suspend_by_clearing}")
    def outer(x, k, *, scale=1):
        runs.append("outer")
        return inner(x) * k * scale  # a registered op inside a registered op's body

    tracer = FakeTracer(suspend_by_clearing)
    x = torch.ones(2)
    result = traced(tracer, lambda: outer(x, 3, scale=2))
    torch.testing.assert_close(result, torch.full((2,), 12.0))
    assert runs == ["outer", "inner"]  # each body ran once, for real
    # one node, targeting the wrapper, with the call's args and kwargs as given
    assert len(tracer.nodes) == 1
    kind, target, args, kwargs = tracer.nodes[0]
    assert kind == "call_function" and target is outer
    assert args[0] is x and args[1:] == (3,) and kwargs == {"scale": 2}
    assert current_tracer() is None
    # and the next call records again (the guard was released)
    traced(tracer, lambda: inner(x))
    assert [node[1] for node in tracer.nodes] == [outer, inner]


def test_call_opaque_exception_releases_the_guard():
    @register_op("a -> a", name="opaque_raises")
    def raises(x):
        raise RuntimeError("boom")

    @register_op("a -> a", name="opaque_after_raise")
    def fine(x):
        return x

    tracer = FakeTracer()
    with pytest.raises(RuntimeError, match="boom"):
        traced(tracer, lambda: raises(1))
    assert tracer.nodes == []
    traced(tracer, lambda: fine(1))
    assert [node[1] for node in tracer.nodes] == [fine]


def test_a_nested_capture_inside_an_op_body_still_records():
    inner_tracer = FakeTracer()

    @register_op("a -> a", name="nested_leaf")
    def leaf(x):
        return x * 2

    @register_op("a -> a", name="nested_outer")
    def outer(x):
        # e.g. a compiled submodule captured while the outer op runs
        return traced(inner_tracer, lambda: leaf(x)) + 1

    outer_tracer = FakeTracer()
    assert traced(outer_tracer, lambda: outer(1)) == 3
    assert [node[1] for node in outer_tracer.nodes] == [outer]
    assert [node[1] for node in inner_tracer.nodes] == [leaf]


# ------------------------------------------------------------------ torch.fx

@register_op("* k+, n k+ -> * n", name="fx_linear")
def fx_linear(x, w):
    return torch.matmul(x, w.t()).relu()  # internals that must not reach the graph


class LinearModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5, 4))

    def forward(self, x):
        return fx_linear(x, self.w) * 2


def call_functions(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_symbolic_trace_records_one_node():
    module = LinearModule()
    gm = torch.fx.symbolic_trace(module)
    targets = call_functions(gm)
    assert targets.count(fx_linear) == 1
    assert torch.matmul not in targets and "relu" not in str(gm.graph)
    assert not [n for n in gm.graph.nodes if n.op == "call_method"]
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), module(x))


def test_symbolic_trace_finds_nested_and_keyword_proxies():
    @register_op("?, ? -> ?", name="fx_cat")
    def cat(tensors, dim=0):
        return torch.cat(tensors, dim=dim)

    @register_op("a, a -> a", name="fx_kw")
    def add(x, y):
        return x + y

    class M(torch.nn.Module):
        def forward(self, x, y):
            return add(x, y=cat([x, y], dim=0)[: x.shape[0]])

    gm = torch.fx.symbolic_trace(M())
    assert call_functions(gm).count(cat) == 1 and call_functions(gm).count(add) == 1
    assert torch.cat not in call_functions(gm)
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(gm(x, y), x + x)


# ------------------------------------------------------------------ get_dropout (the seeds)

@register_op("?, ? -> ?")
def get_dropout(training, dropout):
    return dropout if training else 0.0


class Attention(torch.nn.Module):
    def __init__(self, use_op):
        super().__init__()
        self.dropout = 0.5
        self.is_causal = True
        self.use_op = use_op

    def forward(self, q, k, v):
        if self.use_op:
            dropout_p = get_dropout(self.training, self.dropout)
        else:
            dropout_p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=dropout_p, is_causal=self.is_causal)


def qkv():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, 8, 16, generator=generator) for _ in range(3)]


def run_seeded(fn, *args):
    torch.manual_seed(1234)
    return fn(*args)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_get_dropout_matches_eager(mode):
    reference, model = Attention(use_op=False), Attention(use_op=True)
    getattr(reference, mode)()
    getattr(model, mode)()
    q, k, v = qkv()
    expected = run_seeded(reference, q, k, v)
    torch.testing.assert_close(run_seeded(model, q, k, v), expected)
    gm = torch.fx.symbolic_trace(model)  # traced in this mode
    assert call_functions(gm).count(get_dropout) == 1  # one node, constant arguments
    torch.testing.assert_close(run_seeded(gm, q, k, v), expected)


def test_get_dropout_train_really_drops():
    model = Attention(use_op=True)
    q, k, v = qkv()
    train_out = run_seeded(model.train(), q, k, v)
    eval_out = run_seeded(model.eval(), q, k, v)
    assert not torch.allclose(train_out, eval_out)


def test_an_op_written_in_python_runs_disarmed_at_hits():
    """At a hit the runner calls a register_op op through _C.call_disarmed: its
    frames run with nothing armed (and the evaluator uninstalled), as eager's do;
    modules it calls run eagerly, compiled ones through their own caches."""
    import inspect

    import nnscaler
    from nnscaler_eval import _C
    from nnscaler_eval.tools import explain

    seen = []
    side = torch.nn.Linear(4, 4)
    compiled_side = nnscaler.compile(torch.nn.Linear(4, 4))

    @nnscaler.register_op("a^ b -> a^ b", name="disarmed_op_test")
    def op(x):
        seen.append((_C.current_config() is None, _C.eval_frame_installed()))
        return side(x) + compiled_side(x)

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return op(self.lin(x)) * 2

    m = M()
    c = nnscaler.compile(m)
    x = torch.randn(2, 4)
    with torch.no_grad():
        want = op(m.lin(x)) * 2
        for _ in range(3):
            assert torch.equal(c(x), want)
    assert seen[-1] == (True, False)
    assert nnscaler.cache_info(m).hits == 2
    assert nnscaler.cache_info(compiled_side).hits >= 2
    (bucket,) = explain._buckets(m)
    (entry,) = bucket.entries
    assert "= C_call_disarmed(fn_" in inspect.getsource(entry.runner)
