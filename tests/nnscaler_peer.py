"""Microsoft nnScaler as a test oracle: where its source is, whether it is installed, its
own test helpers, and one gloo rank on CPU to run the modules it generates.

One place for what the nnScaler test files share (`make test-nnscaler` runs them in
`.venv-nnscaler`, where nnScaler's wheel is installed beside ours), and for
tests/nnscaler_suite/run.py's default tarball.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
from pathlib import Path
from types import ModuleType
from typing import Iterator, Optional

REPO = Path(__file__).resolve().parent.parent
PEER_SRC = Path(os.environ.get("NNSCALER_PEER_SRC", REPO / "build" / "nnscaler-peer" / "nnscaler"))


def peers() -> Optional[Path]:
    """The folder with nnScaler's source tarball (../shared/peers, from the checkout or
    a worktree under wt/; NNSCALER_PEERS overrides), or None."""
    explicit = os.environ.get("NNSCALER_PEERS")
    for candidate in ([Path(explicit)] if explicit else
                      [REPO.parent / "shared" / "peers", REPO.parent.parent / "shared" / "peers"]):
        if candidate.is_dir() and list(candidate.glob("nnscaler-*.tar.gz")):
            return candidate
    return None


def tarball() -> Optional[Path]:
    """nnScaler's source tarball in `peers()`, or None."""
    folder = peers()
    return sorted(folder.glob("nnscaler-*.tar.gz"))[0] if folder is not None else None


def require_nnscaler(installed: bool = True) -> None:
    """Skip the calling test module without nnScaler's source (and, with `installed`,
    without nnScaler installed in this interpreter)."""
    import pytest   # here: run.py, a script, imports this module for tarball()

    if peers() is None:
        pytest.skip("../shared/peers/nnscaler-*.tar.gz (Microsoft nnScaler's source) not found: "
                    "nothing to test against", allow_module_level=True)
    if installed and importlib.util.find_spec("nnscaler.graph") is None:
        pytest.skip("Microsoft nnScaler is not installed in this interpreter: `make test-nnscaler` "
                    "(run by `make test`) runs these tests in .venv-nnscaler",
                    allow_module_level=True)


def peer_test_utils() -> ModuleType:
    """nnScaler's own test helpers (tests/utils.py of its source), loaded by path."""
    path = PEER_SRC / "tests" / "utils.py"
    assert path.is_file(), f"{path} missing: `make test-nnscaler` unpacks nnScaler's source there"
    spec = importlib.util.spec_from_file_location("_nnscaler_peer_test_utils", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def cpu_rank() -> Iterator[None]:
    """One gloo rank and nnScaler's CPU device helpers (`replace_all_device_with`,
    `mock_cube_env`), as nnScaler's own 1-GPU tests run on CPU."""
    import torch

    utils = peer_test_utils()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with utils.replace_all_device_with("cpu"), utils.mock_cube_env(0, 1):
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()
