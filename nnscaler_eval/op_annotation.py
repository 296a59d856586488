"""nnScaler's dimension-annotation grammar, as `register_op` accepts it.

    '* k+, n k+ -> * n'                 a linear layer: k is summed away
    '(h^ m^) kd+, kd+ n -> h^ m^ n'     a dimension split into sub-dimensions
    '?, ? -> ?'                         arguments that are not (annotated) tensors

The exact grammar (any `str.isspace()` character counts as a space; spaces around
`,`, `->`, `(` and `)` are optional):

    annotation := tensors '->' tensors          exactly one '->'
    tensors    := tensor (',' tensor)*          no empty tensor: ', ->' is an error
    tensor     := '?'                           not a tensor, or shape not annotated
                | item (SPACES item)*           dimensions separated by spaces
    item       := '*'                           any number of dims; once per tensor
                | NUMBER                        a fixed-size dimension
                | NAME [MARKER]
                | '(' member (SPACES member)* ')'   a dimension split into sub-dims
    member     := NAME [MARKER] | NUMBER        groups do not nest, are not empty
    MARKER     := '+' | '^'                     right after the name, no space between
    NAME       := [A-Za-z_][A-Za-z0-9_]*
    NUMBER     := [0-9]+

`+` marks a reduction (value-partitioned) dimension, `^` one that cannot be
partitioned; a NUMBER is never partitioned and takes no marker. Rules checked after
parsing:

- every NAME used in an output appears in some input (numbers excepted), directly or
  as a group member: `'(h^ m^) kd+, kd+ n -> h^ m^ n'` uses `h` and `m` on their own;
- `*` in an output needs `*` in some input;
- a `+` dimension is summed away: it may not appear in any output, marked or not;
- one name has one marker everywhere it appears, outputs included (`h^` in an input
  and `h` in an output is an error).

Errors are `AnnotationError`s whose message quotes the annotation and puts a caret
under the offending column.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import EllipsisType
from typing import Callable, Iterator, Optional, Union

ERROR_PREFIX = "nnscaler.register_op"

_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_DIGITS = frozenset("0123456789")
_NAME_CHARS = _NAME_START | _DIGITS
_TENSOR_END = (",", "->", "end")
_MARKERS = ("+", "^")


class AnnotationError(ValueError):
    """An annotation that does not parse or does not make sense.

    `reason` says what is wrong, `annotation` is the text, `column` the 0-based offset
    the caret points at (`len(annotation)` for "at the end").
    """

    def __init__(self, reason: str, annotation: str, column: int) -> None:
        super().__init__(reason, annotation, column)
        self.reason = reason
        self.annotation = annotation
        self.column = column

    def __str__(self) -> str:
        # Spaces of every kind print as one column each, so the caret lines up.
        shown = "".join(" " if ch.isspace() else ch for ch in self.annotation)
        return f"{ERROR_PREFIX}: {self.reason}\n  '{shown}'\n   {' ' * self.column}^"


@dataclass(frozen=True)
class Dim:
    """One dimension: a name (`k`), or the digits of a fixed-size dimension (`1`)."""

    name: str
    reduce: bool = False  # '+': value-partitioned, summed away by the op
    frozen: bool = False  # '^' (and every fixed-size dim): cannot be partitioned
    column: int = field(default=-1, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.reduce and self.frozen:
            raise ValueError(f"dimension {self.name!r} cannot be both '+' and '^'")

    @property
    def size(self) -> Optional[int]:
        """The size of a fixed-size dimension (`1` -> 1); None for a named one."""
        return int(self.name) if self.name.isdecimal() else None

    def __str__(self) -> str:
        if self.size is not None:
            return self.name
        return self.name + ("+" if self.reduce else "^" if self.frozen else "")


@dataclass(frozen=True)
class DimGroup:
    """`(h^ m^)`: one tensor dimension made of sub-dimensions, outermost first."""

    dims: tuple[Dim, ...]
    column: int = field(default=-1, compare=False, repr=False)

    def __str__(self) -> str:
        return "(" + " ".join(map(str, self.dims)) + ")"


# `...` (Python's Ellipsis) stands for `*` in TensorAnno.dims.
DimItem = Union[Dim, DimGroup, EllipsisType]


@dataclass(frozen=True)
class TensorAnno:
    """One argument or result: its dimensions, or None for `?`."""

    dims: Optional[tuple[DimItem, ...]]
    column: int = field(default=-1, compare=False, repr=False)

    @property
    def is_unknown(self) -> bool:
        return self.dims is None

    def names(self) -> Iterator[Dim]:
        """Every named or fixed-size Dim, group members included, in order."""
        for item in self.dims or ():
            if isinstance(item, DimGroup):
                yield from item.dims
            elif isinstance(item, Dim):
                yield item

    def __str__(self) -> str:
        if self.dims is None:
            return "?"
        return " ".join("*" if item is ... else str(item) for item in self.dims)


@dataclass(frozen=True)
class OpAnnotation:
    """A parsed annotation. Equality is structural: the spacing of `text` is ignored."""

    inputs: tuple[TensorAnno, ...]
    outputs: tuple[TensorAnno, ...]
    text: str = field(compare=False)
    arrow_column: int = field(default=-1, compare=False, repr=False)

    def __str__(self) -> str:
        return (", ".join(map(str, self.inputs)) + " -> "
                + ", ".join(map(str, self.outputs)))


def parse_annotation(text: str) -> OpAnnotation:
    """Parse and validate `text`; raises AnnotationError saying what and where."""
    if not isinstance(text, str):
        raise TypeError(f"{ERROR_PREFIX}: an annotation is a str like 'a b -> a b', "
                        f"not {type(text).__name__}")
    return _Parser(text).parse()


# --------------------------------------------------------------------------- lexing

@dataclass(frozen=True)
class _Token:
    kind: str      # 'name' 'number' '+' '^' '(' ')' '*' '?' ',' '->' 'end'
    text: str
    column: int
    spaced: bool   # preceded by a space (or by nothing at all)


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    i, n, spaced = 0, len(text), True
    while i < n:
        ch = text[i]
        if ch.isspace():
            i, spaced = i + 1, True
            continue
        start = i
        if ch in _NAME_START:
            while i < n and text[i] in _NAME_CHARS:
                i += 1
            kind = "name"
        elif ch in _DIGITS:
            while i < n and text[i] in _DIGITS:
                i += 1
            if i < n and text[i] in _NAME_CHARS:
                while i < n and text[i] in _NAME_CHARS:
                    i += 1
                raise AnnotationError(
                    f"{text[start:i]!r} is not a valid dimension: a name is "
                    "[A-Za-z_][A-Za-z0-9_]* (it cannot start with a digit) and a "
                    "fixed-size dimension is digits only", text, start)
            kind = "number"
        elif text.startswith("->", i):
            i, kind = i + 2, "->"
        elif ch in "+^()*?,":
            i, kind = i + 1, ch
        elif ch == "-":
            raise AnnotationError(
                "stray '-': inputs and outputs are separated by '->'", text, i)
        else:
            raise AnnotationError(
                f"unexpected character {ch!r}: an annotation holds names "
                "([A-Za-z_][A-Za-z0-9_]*), numbers, '+', '^', '(', ')', '*', '?', ',' "
                "and '->'", text, i)
        tokens.append(_Token(kind, text[start:i], start, spaced))
        spaced = False
    tokens.append(_Token("end", "", n, spaced))
    return tokens


# -------------------------------------------------------------------------- parsing

def _describe_marker(marker: str) -> str:
    return {"+": "marked '+' (reduction)", "^": "marked '^' (not partitionable)",
            "": "unmarked (partitionable)"}[marker]


class _Parser:
    """Recursive descent over the tokens; the first error found, left to right, wins."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.pos = 0

    def peek(self) -> _Token:
        return self.tokens[self.pos]

    def take(self) -> _Token:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def error(self, reason: str, column: int) -> AnnotationError:
        return AnnotationError(reason, self.text, column)

    def parse(self) -> OpAnnotation:
        if self.peek().kind == "end":
            raise self.error("empty annotation: expected 'inputs -> outputs', "
                             "e.g. 'a b -> a b'", 0)
        inputs = self.tensors("input")
        arrow = self.take()
        if arrow.kind != "->":  # tensors() stops only at '->' or the end
            raise self.error("missing '->' between the inputs and the outputs",
                             arrow.column)
        outputs = self.tensors("output")
        extra = self.peek()
        if extra.kind == "->":
            raise self.error("a second '->': an annotation has exactly one '->', "
                             "between the inputs and the outputs", extra.column)
        assert extra.kind == "end", extra
        _validate(self.text, inputs, outputs)
        return OpAnnotation(tuple(inputs), tuple(outputs), self.text, arrow.column)

    def tensors(self, side: str) -> list[TensorAnno]:
        result = [self.tensor(side)]
        while self.peek().kind == ",":
            self.take()
            result.append(self.tensor(side))
        return result

    def tensor(self, side: str) -> TensorAnno:
        first = self.peek()
        if first.kind in _TENSOR_END:
            where = {",": "before ','", "->": "before '->'", "end": "at the end"}[first.kind]
            raise self.error(f"empty {side} annotation {where}: write its dimensions, "
                             "or '?' for an argument that is not a tensor", first.column)
        if first.kind == "?":
            self.take()
            self.no_marker("'?'")
            after = self.peek()
            if after.kind not in _TENSOR_END:
                raise self.error("'?' stands for a whole argument and cannot be mixed "
                                 "with dimensions", after.column)
            return TensorAnno(None, first.column)
        items: list[DimItem] = []
        star: Optional[_Token] = None
        while self.peek().kind not in _TENSOR_END:
            token = self.peek()
            if items and not token.spaced and token.kind not in (*_MARKERS, ")"):
                raise self.error("dimensions must be separated by spaces", token.column)
            if token.kind == "*":
                if star is not None:
                    raise self.error(f"'*' appears twice in one tensor (first at column "
                                     f"{star.column}); it may appear at most once",
                                     token.column)
                star = self.take()
                self.no_marker("'*'")
                items.append(...)
            elif token.kind == "number":
                items.append(self.number())
            elif token.kind == "name":
                items.append(self.name())
            elif token.kind == "(":
                items.append(self.group())
            elif token.kind == "?":
                raise self.error("'?' stands for a whole argument and cannot be mixed "
                                 "with dimensions", token.column)
            elif token.kind == ")":
                raise self.error("unmatched ')'", token.column)
            else:
                self.misplaced_marker(token)
        return TensorAnno(tuple(items), first.column)

    def name(self) -> Dim:
        token = self.take()
        marker = ""
        after = self.peek()
        if after.kind in _MARKERS and not after.spaced:
            marker = self.take().kind
            again = self.peek()
            if again.kind in _MARKERS and not again.spaced:
                raise self.error(
                    f"dimension {token.text!r} has two markers ('{marker}' then "
                    f"'{again.kind}'): use at most one, '+' (reduction) or '^' "
                    "(not partitionable)", again.column)
        return Dim(token.text, marker == "+", marker == "^", token.column)

    def number(self) -> Dim:
        token = self.take()
        self.no_marker(f"fixed-size dimension {token.text!r}", " (it is never partitioned)")
        return Dim(token.text, False, True, token.column)

    def group(self) -> DimGroup:
        opening = self.take()
        members: list[Dim] = []
        while True:
            token = self.peek()
            if token.kind == ")":
                if not members:
                    raise self.error("empty group '()': a group holds one or more "
                                     "dimension names", opening.column)
                self.take()
                break
            if token.kind == "(":
                raise self.error("groups cannot be nested", token.column)
            if token.kind in _TENSOR_END:
                raise self.error("unclosed '(': expected ')'", opening.column)
            if members and not token.spaced and token.kind not in _MARKERS:
                raise self.error("dimensions must be separated by spaces", token.column)
            if token.kind == "name":
                members.append(self.name())
            elif token.kind == "number":
                members.append(self.number())
            elif token.kind in ("*", "?"):
                raise self.error(f"'{token.kind}' cannot appear inside a group",
                                 token.column)
            else:
                self.misplaced_marker(token)
        self.no_marker("a group", ": mark the dimensions inside it")
        return DimGroup(tuple(members), opening.column)

    def no_marker(self, what: str, hint: str = "") -> None:
        token = self.peek()
        if token.kind in _MARKERS and not token.spaced:
            raise self.error(f"{what} takes no marker '{token.kind}'{hint}", token.column)

    def misplaced_marker(self, token: _Token) -> None:
        assert token.kind in _MARKERS, token
        raise self.error(f"marker '{token.kind}' must directly follow a dimension "
                         "name, with no space between", token.column)


# ----------------------------------------------------------------------- validation

def _marker(dim: Dim) -> str:
    return "+" if dim.reduce else "^" if dim.frozen else ""


def _validate(text: str, inputs: list[TensorAnno], outputs: list[TensorAnno]) -> None:
    first_use: dict[str, Dim] = {}

    def check_consistent(dim: Dim) -> None:
        first = first_use.setdefault(dim.name, dim)
        if _marker(first) != _marker(dim):
            raise AnnotationError(
                f"dimension {dim.name!r} is {_describe_marker(_marker(dim))} here but "
                f"{_describe_marker(_marker(first))} at column {first.column}; a name "
                "has the same marker everywhere", text, dim.column)

    input_star = False
    for tensor in inputs:
        input_star = input_star or any(item is ... for item in tensor.dims or ())
        for dim in tensor.names():
            if dim.size is None:
                check_consistent(dim)
    for tensor in outputs:
        for item in tensor.dims or ():
            if item is ...:
                if not input_star:
                    raise AnnotationError("'*' in the output needs a '*' in some input",
                                          text, _star_column(text, tensor))
                continue
            for dim in item.dims if isinstance(item, DimGroup) else (item,):
                if dim.size is None:
                    _check_output_dim(text, dim, first_use, check_consistent)


def _check_output_dim(text: str, dim: Dim, first_use: dict[str, Dim],
                      check_consistent: Callable[[Dim], None]) -> None:
    if dim.reduce:
        raise AnnotationError(
            f"reduction dimension '{dim.name}+' in the output: a '+' dimension is "
            "summed away by the op and appears only in the inputs",
            text, dim.column + len(dim.name))
    first = first_use.get(dim.name)
    if first is None:
        raise AnnotationError(f"dimension {dim.name!r} in the output is not defined by "
                              "any input", text, dim.column)
    if first.reduce:
        raise AnnotationError(
            f"dimension {dim.name!r} in the output is a reduction dimension "
            f"('{dim.name}+' at column {first.column}): it is summed away and cannot "
            "appear in the outputs", text, dim.column)
    check_consistent(dim)


def _star_column(text: str, tensor: TensorAnno) -> int:
    # The '*' of `tensor`: the first '*' at or after the tensor's own column.
    return text.index("*", tensor.column)
