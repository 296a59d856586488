"""Call-heavy pure-Python workloads for the hook-tax case.  This module imports
nothing: the subprocess that measures "without the package" runs exactly this code.
"""
from __future__ import annotations


def fib(n: int) -> int:
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def fib_frames(n: int) -> int:
    """Python frames one fib(n) call creates: 2 * fib(n + 1) - 1."""
    a, b = 0, 1
    for _ in range(n + 1):
        a, b = b, a + b
    return 2 * a - 1


class Point:
    def __init__(self, x: float, y: float) -> None:
        self.x = x
        self.y = y

    def norm2(self) -> float:
        return square(self.x) + square(self.y)


def square(v: float) -> float:
    return v * v


def leaf(i: int) -> float:
    return Point(i, i + 1).norm2()


def middle(i: int) -> float:
    return leaf(i) + 1.0


def outer(i: int) -> float:
    return middle(i) * 0.5


NESTED_ITEMS = 200


def nested() -> float:
    """200 x (outer -> middle -> leaf -> Point.__init__ + norm2 -> 2 x square)."""
    total = 0.0
    for i in range(NESTED_ITEMS):
        total += outer(i)
    return total


NESTED_FRAMES = 1 + NESTED_ITEMS * 7
FIB_N = 20


def fib20() -> int:
    return fib(FIB_N)


WORKLOADS = {
    "fib(20)": (fib20, 1 + fib_frames(FIB_N)),
    "nested calls": (nested, NESTED_FRAMES),
}
