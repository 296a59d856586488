"""Leak checking for the C paths: run a workload, warm up, then check that allocated
blocks (every leaked object is one) and traced memory stay flat over more rounds.

On a release build there is no sys.gettotalrefcount; sys.getallocatedblocks() counts
live pymalloc blocks, which a reference leak of any small object raises.
"""
from __future__ import annotations

import gc
import sys
import tracemalloc
from typing import Callable


# Set by conftest.py when pytest runs with --run-slow (`make leakcheck`).
LONG = False


def assert_flat(workload: Callable[[], None], rounds: int = 4, block_slack: int = 200,
                byte_slack: int = 256 * 1024, warmup: int = 1) -> None:
    if LONG:
        rounds *= 3   # make leakcheck: the same soaks, three times the rounds
    for _ in range(warmup):
        workload()  # warm caches, interned strings, first-time allocations
    gc.collect()
    tracemalloc.start()
    try:
        workload()
        gc.collect()
        blocks0 = sys.getallocatedblocks()
        mem0, _ = tracemalloc.get_traced_memory()
        for _ in range(rounds - 1):
            workload()
        gc.collect()
        blocks1 = sys.getallocatedblocks()
        mem1, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    grew_blocks = blocks1 - blocks0
    grew_bytes = mem1 - mem0
    assert grew_blocks <= block_slack and grew_bytes <= byte_slack, (
        f"leak: {grew_blocks} more allocated blocks, {grew_bytes} more traced bytes "
        f"after {rounds - 1} more rounds"
    )
