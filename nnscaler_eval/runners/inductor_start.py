"""Inductor's once-per-process start for CPU code, begun early, in parallel.

Inductor's first C++ code generation in a process asks which vector instruction sets
(AVX-512 VNNI, AVX-512, AVX2, ...: those the CPU's flags name) the compiler and the
CPU can use.  Per candidate it builds probes that include ATen's vector headers (into
Inductor's cache folder: once per folder) and loads each in a child process (once per
process), one candidate after the other.  On a 2-core machine that is about 7 of the 16
wall seconds of a cold first call of the 12-block GPT in eval, and 1 s of a warm one
(benchmarks/cold_start.py), paid after our capture, at Inductor's first code
generation.

`begin()` has Inductor answer the same questions, by its own code (`bool(isa)`, which
it memoises per candidate), one thread per candidate, as soon as a module is compiled
or a capture starts for Inductor on the CPU: the builds and loads run in child
processes, beside each other and beside the import of Dynamo, the user's code between
`compile()` and the first call, the capture, AOTAutograd and Inductor's lowering.
Inductor must not ask a question that is still being answered (its AVX-512 question
edits the candidate's flags while it runs), so while the threads run, Inductor's
`cpu_vec_isa.valid_vec_isa_list` (the one place it asks, memoised; every later use
of an answer goes through it) first waits for them: Inductor's first C++ code
generation, not the start of a compile, is where a first call waits.  The threads
put Inductor's function back when they are done.  Nothing is decided here: the
answers and their side effects are Inductor's.  A question that fails is left
unanswered; Inductor asks it again and reports it.

Only compiles for Inductor of something that computes on the CPU begin it: a model
on a GPU does not need the CPU's instruction sets and pays nothing.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterable, Optional

import torch

from nnscaler_eval import _C

_lock = threading.Lock()
_asking: Optional[threading.Thread] = None
# Set once Inductor's questions wait for the threads (or once there is nothing to
# wait for): from then on Inductor may run.
_guarded = threading.Event()


def begin_for(backend_name: str, module: Any = None, values: Iterable[Any] = ()) -> None:
    """`begin()` when `backend_name` is Inductor and the call computes on the CPU: a
    CPU tensor among `values`, or `module`'s first parameter (or buffer) on the CPU."""
    if _asking is None and backend_name == "inductor" and _on_cpu(module, values):
        begin()


def begin() -> None:
    """Start asking (once per process); returns at once."""
    _C.call_holding(_lock, _start_once)


def _start_once() -> None:
    global _asking
    if _asking is None:
        _asking = threading.Thread(target=_ask_every_candidate,
                                   name="nnscaler-inductor-start", daemon=True)
        _asking.start()


def ready() -> None:
    """Before a graph is handed to Inductor: wait until Inductor's questions wait for
    the threads (a moment after `begin()`), not for the answers; not for a thread that
    is gone (a process forked meanwhile has none).  A Ctrl-C interrupts the wait."""
    asking = _asking
    if asking is None:
        return
    while not _guarded.wait(0.1):
        if not asking.is_alive():
            return


def _on_cpu(module: Any, values: Iterable[Any]) -> bool:
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return True
    if isinstance(module, torch.nn.Module):
        for tensor in module.parameters():
            return tensor.device.type == "cpu"
        for tensor in module.buffers():
            return tensor.device.type == "cpu"
    return False


def _ask_every_candidate() -> None:
    try:
        _ask_guarded()
    finally:
        _guarded.set()   # also when something failed: nothing left to wait for


def _ask_guarded() -> None:
    try:
        from torch._inductor import cpu_vec_isa

        candidates = _candidates(cpu_vec_isa)
        asked = cpu_vec_isa.valid_vec_isa_list
    except Exception:  # a torch without Inductor's CPU backend: nothing to begin
        return
    askers: list[threading.Thread] = []
    for i, isa in enumerate(candidates):
        asker = threading.Thread(target=_ask, args=(isa,), daemon=True,
                                 name=f"nnscaler-inductor-start-{i}")
        try:
            asker.start()
        except RuntimeError:   # no thread to be had: Inductor asks the rest itself
            break
        askers.append(asker)
    waiting = _waiting_for(askers, asked)
    cpu_vec_isa.valid_vec_isa_list = waiting
    _guarded.set()
    try:
        for asker in askers:
            asker.join()
    finally:
        if cpu_vec_isa.valid_vec_isa_list is waiting:
            cpu_vec_isa.valid_vec_isa_list = asked


def _waiting_for(askers: list[threading.Thread], asked: Callable[[], Any]) -> Callable[[], Any]:
    """Inductor's `valid_vec_isa_list`, which first waits for the threads asking."""
    @functools.wraps(asked)
    def valid_vec_isa_list() -> Any:
        for asker in askers:
            if asker is not threading.current_thread():
                asker.join()
        return asked()

    cache_clear = getattr(asked, "cache_clear", None)
    if cache_clear is not None:
        valid_vec_isa_list.cache_clear = cache_clear  # type: ignore[attr-defined]
    return valid_vec_isa_list


def _candidates(cpu_vec_isa: Any) -> list[Any]:
    """The candidates Inductor will ask about on this machine, its own objects: on x86,
    those of its list whose flags the CPU has (the filter its `valid_vec_isa_list`
    applies before building anything).  Elsewhere it asks about one at most: nothing
    to run side by side, and nothing is begun."""
    import platform
    import sys

    if sys.platform not in ("linux", "win32") or platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list
            if all(flag in flags for flag in str(isa).split())]


def _ask(isa: Any) -> None:
    try:
        bool(isa)   # Inductor's question, memoised by Inductor
    except Exception:
        return
