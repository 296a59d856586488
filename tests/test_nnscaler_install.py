"""nnscaler-eval and Microsoft nnScaler installed in one environment, in either order.

Each case makes a throwaway venv (no pip of its own: the running interpreter's pip
installs into it with `--python`), installs the two wheels `make test-nnscaler` builds
into build/wheels in some order, then uninstalls one, and checks what users call in a
fresh interpreter. torch and nnScaler's other requirements come from this environment
through a .pth file naming a directory of links to its site-packages, minus both
projects, so that nothing but the wheels under test provides `nnscaler`.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


from nnscaler_peer import require_nnscaler  # noqa: E402

require_nnscaler()

WHEELS = Path(os.environ.get("NNSCALER_WHEELS", REPO / "build" / "wheels"))
OURS = "nnscaler-eval"
THEIRS = "nnscaler"
_OWN = ("nnscaler", "nnscaler_eval", "_nnscaler_eval_ns", "__editable__")


def _wheel(prefix: str) -> Path:
    found = sorted(WHEELS.glob(f"{prefix}-*.whl"))
    assert found, f"no {prefix}-*.whl in {WHEELS}: run `make test-nnscaler` (it builds them)"
    return found[-1]


@pytest.fixture(scope="module")
def deps_dir(tmp_path_factory) -> Path:
    site = Path(sysconfig.get_paths()["purelib"])
    view = tmp_path_factory.mktemp("deps")
    for entry in site.iterdir():
        if entry.name.startswith(_OWN) or entry.suffix == ".pth":
            continue
        (view / entry.name).symlink_to(entry)
    return view


def _venv(tmp_path: Path, deps_dir: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_test_deps.pth").write_text(f"{deps_dir}\n")
    return venv


def _pip(venv: Path, *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                           *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _install(venv: Path, name: str) -> None:
    _pip(venv, "install", "-q", "--no-deps", "--no-index",
         str(_wheel("nnscaler_eval" if name == OURS else "nnscaler")))


def _run(venv: Path, code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(venv / "bin" / "python"), "-c", textwrap.dedent(code)],
                          cwd=venv.parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout, done.stdout + done.stderr
    return done.stdout


def _records(venv: Path) -> dict[str, set[str]]:
    site = next((venv / "lib").glob("python*/site-packages"))
    owned = {}
    for record in site.glob("*.dist-info/RECORD"):
        name = record.parent.name.split("-")[0]
        with open(record, newline="") as f:
            owned[name] = {row[0] for row in csv.reader(f) if row
                           and ".dist-info/" not in row[0]}
    return owned


_OUR_NAMES = """
    import torch, nnscaler
    from nnscaler.eval_frame import enable, disable
    from nnscaler.runtime.function import ifexpr
    assert ifexpr(True, 1, 2) == 1 and ifexpr(False, 1, 2) == 2

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) * (2.0 if self.training else 0.5)

    x = torch.randn(2, 3)
    m = nnscaler.compile(M())
    ref = m.lin(x)
    assert torch.allclose(m(x), ref * 2.0)
    m.eval()
    assert torch.allclose(m(x), ref * 0.5)
    assert nnscaler.cache_info(m).captures == 1, nnscaler.cache_info(m)
    with enable():
        assert torch.allclose(M.forward(m, x), ref * 0.5)
    with disable():
        assert torch.allclose(m(x), ref * 0.5)
    gm = nnscaler.export(M(), x)
    assert any(n.op == "call_function" and getattr(n.target, "__name__", "") == "ifexpr"
               for n in gm.graph.nodes), gm.code
    with open("ops_mod.py", "w") as f:
        f.write("import nnscaler\\n"
                "@nnscaler.register_op('a b -> a b')\\n"
                "def twice(x):\\n"
                "    return x + x\\n")
    import sys; sys.path.insert(0, ".")
    import ops_mod
    assert torch.equal(ops_mod.twice(x), x + x)
"""


def _check_both(venv: Path) -> None:
    _run(venv, _OUR_NAMES + """
    from nnscaler import parallelize, ComputeConfig, __version__
    assert parallelize.__module__ == "nnscaler.parallel" and __version__ == "0.8"
    # nnScaler's own register_op: installing us changes nothing of its contract
    assert nnscaler.register_op.__module__ == "nnscaler.graph.parser.register"
    from nnscaler.graph.parser.register import CustomizedOps
    # one registration, both registries: nnScaler holds the function, ours its body
    assert CustomizedOps.kOpRuntime["ops_mod.twice"] is ops_mod.twice
    assert nnscaler.registered_ops()["ops_mod.twice"].__wrapped__ is ops_mod.twice.__wrapped__
    from nnscaler_eval.parallelize import export_for_nnscaler
    class Use(torch.nn.Module):
        def forward(self, x):
            return ops_mod.twice(x) * 3
    gm = export_for_nnscaler(Use(), x)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][0] is ops_mod.twice
    print("OK")
    """)


def _check_ours_only(venv: Path) -> None:
    _run(venv, _OUR_NAMES + """
    assert nnscaler.__file__.endswith("nnscaler_eval/_nnscaler/__init__.py"), nnscaler.__file__
    assert not hasattr(nnscaler, "parallelize")
    assert ifexpr.__module__ == "nnscaler.runtime.function"
    print("OK")
    """)


def _check_theirs_only(venv: Path) -> None:
    _run(venv, """
    import importlib.util, nnscaler
    from nnscaler import parallelize, ComputeConfig, __version__
    from nnscaler.runtime.function.function import ifexpr
    import nnscaler.runtime.function
    assert importlib.util.find_spec("nnscaler_eval") is None
    assert importlib.util.find_spec("_nnscaler_eval_ns") is None
    assert not hasattr(nnscaler, "compile") and not hasattr(nnscaler, "export")
    assert nnscaler.register_op.__module__ == "nnscaler.graph.parser.register"
    print("OK")
    """)


def _check_disjoint(venv: Path) -> None:
    owned = _records(venv)
    assert set(owned) == {"nnscaler", "nnscaler_eval"}, owned.keys()
    shared = owned["nnscaler"] & owned["nnscaler_eval"]
    assert not shared, shared
    assert not any(p.startswith("nnscaler/") for p in owned["nnscaler_eval"])


@pytest.mark.parametrize("order", [(OURS, THEIRS), (THEIRS, OURS)], ids=["ours-first", "theirs-first"])
def test_install_in_either_order_then_uninstall_the_other(order, tmp_path, deps_dir):
    venv = _venv(tmp_path, deps_dir)
    for name in order:
        _install(venv, name)
    _check_disjoint(venv)
    _check_both(venv)
    first = order[0]
    _pip(venv, "uninstall", "-y", "-q", first)
    if first == OURS:
        _check_theirs_only(venv)
    else:
        _check_ours_only(venv)


def test_ours_alone_then_theirs_added(tmp_path, deps_dir):
    venv = _venv(tmp_path, deps_dir)
    _install(venv, OURS)
    _check_ours_only(venv)
    _install(venv, THEIRS)
    _check_both(venv)
    _pip(venv, "uninstall", "-y", "-q", THEIRS)
    _check_ours_only(venv)
