"""FSDP2 and DDP (2 gloo processes on CPU, in a subprocess with a timeout): training
with a compiled model equals eager training of the same wrapped model, and the
compiled one does not recapture per step."""
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind, forwards", [("fsdp2", 3), ("ddp", 2)])
def test_training_equals_eager_without_recaptures(kind, forwards, tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built in")
    out = tmp_path / "result.pt"
    # Its own session: on a timeout the ranks go too, not just the launcher. The
    # worker's watchdogs (180 s, 210 s for the launcher) print stacks before this.
    worker = subprocess.Popen([sys.executable, WORKER, kind, str(_free_port()), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        stdout, stderr = worker.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        stdout, stderr = worker.communicate()
        pytest.fail(f"{kind} worker hung past its watchdogs; its output:\n"
                    f"{stdout[-2000:]}\n{stderr[-6000:]}")
    assert worker.returncode == 0, stderr[-6000:]
    result = torch.load(out)
    assert result["compiled"] == pytest.approx(result["eager"], abs=1e-6)
    for name, value in result["eager_state"].items():
        torch.testing.assert_close(result["compiled_state"][name], value, msg=name)
    captures, hits, misses, fallbacks, entries = result["cache_info"]
    print(f"{kind}: after 5 steps captures={captures} hits={hits} misses={misses} "
          f"fallbacks={fallbacks} entries={entries}")
    # One capture per distinct forward (FSDP2: the root and the two sharded blocks,
    # which have hooks and so are captured on their own; DDP: its wrapper, which falls
    # back, and the model), none per step.
    assert captures + fallbacks - (hits if kind == "ddp" else 0) <= forwards + 3
    assert misses <= forwards
