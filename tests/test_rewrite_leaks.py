"""The rewrite must not leak: every owned reference and every PyMem block is released
on success and on every error path, and rewritten code runs without growing memory.

Memory is measured with tracemalloc (which sees PyMem_Malloc as well as objects),
sys.getallocatedblocks() and the number of gc-tracked objects, after a warm-up, so that
caches filled once (interned strings, type caches, free lists) do not count.
"""
from __future__ import annotations

import gc
import sys
import tracemalloc

import pytest

from rewrite_util import rewrite, rewritten

from nnscaler_eval.runtime import ifexpr

# Small enough to compile 11,000 times in a few seconds; still four sites (one nested,
# one negated, one under an exception handler) and one jump-context ternary left alone.
SOURCE = """
def method(self, a, b):
    x = (a.p if self.training else {k})
    try:
        y = (a if not self.training else (b if self.training else {k}))
        z = b if self.training else a.p
    except Exception:
        y = z = 0
    if (a if self.training else b):
        z += 1
    return x, y, z
"""

# slack for allocations that are not per-iteration (tracemalloc's own bookkeeping,
# a free list growing once)
BYTES_SLACK = 64 * 1024
BLOCKS_SLACK = 200
OBJECTS_SLACK = 50


class Model:
    def __init__(self, training):
        self.training = training


class A:
    p = 1.5


def measure(traced):
    gc.collect()
    return (tracemalloc.get_traced_memory()[0] if traced else 0, sys.getallocatedblocks(),
            len(gc.get_objects()))


WARMUP = 1000


def assert_flat(step, iterations, traced=True):
    """Run step(i) `iterations` times after a warm-up; memory must not grow.  With
    `traced`, tracemalloc watches too (it sees PyMem_Malloc, which the allocated-block
    count misses above 512 bytes, but slows Python code down several times)."""
    for i in range(WARMUP):
        step(i)
    if traced:
        tracemalloc.start()
    try:
        before = measure(traced)
        for i in range(WARMUP, WARMUP + iterations):
            step(i)
        after = measure(traced)
    finally:
        if traced:
            tracemalloc.stop()
    grown = [a - b for a, b in zip(after, before)]
    assert grown[0] < BYTES_SLACK, f"traced memory grew by {grown[0]} bytes"
    assert grown[1] < BLOCKS_SLACK, f"allocated blocks grew by {grown[1]}"
    assert grown[2] < OBJECTS_SLACK, f"gc objects grew by {grown[2]}"


def fresh_code(i):
    module = compile(SOURCE.format(k=i % 13), f"<leak-{i % 3}>", "exec")
    return next(c for c in module.co_consts if hasattr(c, "co_code"))


def test_rewrite_10000_fresh_code_objects():
    refs_before = sys.getrefcount(ifexpr)
    # compiled up front: compiling under tracemalloc would take most of the time
    codes = [fresh_code(i) for i in range(WARMUP + 10_000)]

    def step(i):
        code = codes[i]
        codes[i] = None     # the last reference: freed right after its rewrite
        new, n_sites = rewrite(code)
        assert n_sites == 4
        again, n_again = rewrite(new)
        assert again is new and n_again == 0

    assert_flat(step, 10_000)
    # the rewritten code objects are gone, and with them their references to ifexpr
    assert sys.getrefcount(ifexpr) == refs_before


def test_error_paths_do_not_leak():
    good = fresh_code(0)
    broken = [
        good.replace(co_exceptiontable=b"\x81"),                 # truncated entry
        good.replace(co_exceptiontable=b"\x80\x01\x7f\x00"),     # target out of range
        good.replace(co_linetable=b"\x01"),                      # no entry marker
        good.replace(co_code=good.co_code[:-2] + bytes([144, 0])),   # EXTENDED_ARG at end
    ]

    def step(i):
        try:
            rewrite(broken[i % len(broken)])
        except ValueError:
            pass
        else:
            raise AssertionError("broken code rewrote")

    assert_flat(step, 10_000)


def test_untouched_paths_do_not_leak():
    def plain(self, a):
        return a + 1

    def jump_context(self, a, b):
        if (a if self.training else b):
            return 1
        return self.training and a

    def step(i):
        for fn in (plain, jump_context):
            new, n_sites = rewrite(fn.__code__)
            assert new is fn.__code__ and n_sites == 0

    assert_flat(step, 10_000)


def test_calling_rewritten_functions_100000_times():
    code = fresh_code(1)
    fn = type(lambda: 0)(code, {})
    new_fn, n_sites = rewritten(fn)
    assert n_sites == 4
    models = (Model(True), Model(False))
    a = A()

    def step(i):
        new_fn(models[i & 1], a, i)

    assert_flat(step, 100_000, traced=False)


FAULT_INJECTION = r'''
import gc, sys
import _testcapi
from nnscaler_eval import _C
from nnscaler_eval.runtime import ifexpr

code = compile(SOURCE, "<nomem>", "exec").co_consts[0]
rewrite_code = _C.rewrite_code

def sweep():
    """Fail the k-th allocation of one rewrite, for every k until rewrites succeed."""
    failed = clean = 0
    k = 0
    while clean <= 20:
        _testcapi.set_nomemory(k, k + 1)
        try:
            rewrite_code(code, ifexpr)
        except MemoryError:
            failed += 1
        else:
            clean += 1 if k > 50 else 0
        finally:
            _testcapi.remove_mem_hooks()
        k += 1
    return failed

sweep()
gc.collect()
blocks = sys.getallocatedblocks()
failed = sum(sweep() for _ in range(20))
gc.collect()
print(failed, sys.getallocatedblocks() - blocks)
'''


def test_allocation_failures_are_clean():
    """Make each allocation of a rewrite fail in turn (CPython's _testcapi hooks):
    every failure must surface as MemoryError, with nothing leaked and no crash.  Runs
    in a subprocess, where a crash is a test failure rather than the end of pytest."""
    import subprocess
    _testcapi = pytest.importorskip("_testcapi")
    if not hasattr(_testcapi, "set_nomemory"):
        pytest.skip("no _testcapi.set_nomemory")
    script = f"SOURCE = {SOURCE.format(k=3)!r}\n" + FAULT_INJECTION
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    failed, grown = map(int, done.stdout.split())
    assert failed > 20 * 20             # many allocations of the rewrite were failed
    assert grown < BLOCKS_SLACK, f"{grown} blocks leaked over 20 sweeps"
