"""Python in the middle of the C paths control flow added: assembling code from a list
that an oparg's `__index__` empties, and captures of `if`/`while` forwards while a gc
callback (run at every allocation) resets every cache and collects.  Eager is the
oracle; nothing may crash, and the library stays usable."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

import nnscaler
from nnscaler_eval import _C
from oracle import agree, twins


def _sample(x):
    if x.sum() > 0:
        return x * 2
    return x - 1


class Clears:
    """An oparg whose __index__ empties the list the instructions came in."""

    def __init__(self, victim: list, value: int) -> None:
        self.victim, self.value = victim, value

    def __index__(self) -> int:
        self.victim.clear()
        gc.collect()
        return self.value


def test_assemble_code_reads_a_snapshot_of_the_instructions():
    code = _sample.__code__
    instructions = _C.code_instructions(code)
    # unchanged, it assembles to code that runs as the original does
    again = _C.assemble_code(code, list(instructions), {})
    rebuilt = type(_sample)(again, _sample.__globals__)
    x = torch.randn(3)
    assert torch.equal(rebuilt(x), _sample(x)) and torch.equal(rebuilt(-x.abs()), _sample(-x.abs()))
    # an oparg that empties the list mid-parse: the C side holds its own tuple
    victim = [tuple(i) for i in instructions]
    opcode, oparg, target, flags, loc, handler = victim[0]
    victim[0] = (opcode, Clears(victim, oparg), target, flags, loc, handler)
    try:
        made = _C.assemble_code(code, victim, {})
    except (TypeError, ValueError):
        pass   # refusing the object is fine; reading freed memory is not
    else:
        assert isinstance(made, type(code))
    assert victim == []


def test_assemble_code_says_what_was_wrong():
    code = _sample.__code__
    with pytest.raises(TypeError, match="sequence"):
        _C.assemble_code(code, 5, {})
    with pytest.raises(TypeError, match="tuple"):
        _C.assemble_code(code, [[1, 0, -1, 0, None, None]], {})
    with pytest.raises(ValueError, match="out of range"):
        _C.assemble_code(code, [(1, 0, 7, 0, None, None)], {})


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        if y.mean() > 0:
            y = y.relu() * 2
        else:
            y = y - 1
        steps = torch.zeros(())
        while steps < (x.abs().sum() > 1).float() * 3:
            steps = steps + 1
        return y + steps


def test_captures_of_if_and_while_with_python_running_at_every_allocation():
    """A gc callback at (almost) every allocation resets every cache of ours: Python
    runs in the middle of whatever C path allocates, the capture's and the hit's, and
    frees what the caches held.  (The callback keeps no state of its own: code run
    while a side is traced on fakes is checked, see docs/limits.md.)"""
    def meddle(phase, info):
        if phase == "start":
            nnscaler.reset()

    compiled, eager = twins(Branches())
    threshold = gc.get_threshold()
    gc.callbacks.append(meddle)
    gc.set_threshold(5)
    try:
        for seed in range(12):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed)) * (seed % 3)
            agree(compiled, eager, x)
    finally:
        gc.callbacks.remove(meddle)
        gc.set_threshold(*threshold)
    # usable afterwards: a fresh capture, hit with either side taken
    nnscaler.reset()
    gc.collect()
    for scale in (1.0, -1.0, 0.0, 2.0, -3.0):
        agree(compiled, eager, torch.ones(2, 4) * scale)
    info = nnscaler.cache_info(compiled)
    assert info.captures == 1 and info.hits == 4, info
