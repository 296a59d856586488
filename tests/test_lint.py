"""Source checks: version tests only in the compat files; C headers state ownership."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
C_FILES = sorted(list((ROOT / "csrc").glob("*.[ch]")) + list((ROOT / "guards").glob("*.[ch]")))


def test_py_version_hex_only_in_compat_files():
    offenders = [p.name for p in C_FILES
                 if "PY_VERSION_HEX" in p.read_text() and "compat" not in p.name]
    assert offenders == []


def test_internal_cpython_headers_only_in_per_version_files():
    offenders = [p.name for p in C_FILES
                 if re.search(r"#\s*include\s*<internal/", p.read_text())
                 and not re.match(r"compat_py3\d+\.c$", p.name)]
    assert offenders == []


def test_every_c_file_starts_with_a_comment_saying_what_it_is():
    for p in C_FILES:
        assert p.read_text().lstrip().startswith("/*"), p.name


def test_no_unfinished_markers():
    # spelled in pieces so that this file does not match itself
    pattern = re.compile(r"\b(" + "|".join(["TO" + "DO", "FIX" + "ME", "X" + "XX"]) + r")\b")
    files = C_FILES + sorted((ROOT / "nnscaler_eval").rglob("*.py")) + [ROOT / "_nnscaler_eval_ns.py"]
    offenders = [p.name for p in files if pattern.search(p.read_text())]
    assert offenders == []
