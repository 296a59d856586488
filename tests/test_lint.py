"""Source checks: version tests only in the compat files; C headers state ownership."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
C_FILES = sorted(p for d in ("csrc", "guards") for pattern in ("*.[ch]", "*.cpp")
                 for p in (ROOT / d).glob(pattern))


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


def test_one_version_file_per_minor_each_naming_its_audited_release():
    compat_h = (ROOT / "csrc" / "compat.h").read_text()
    minors = sorted(int(m) for m in re.findall(r"#\s*define NNS_PY3(\d+) 1", compat_h))
    assert minors == [11, 12, 13, 14]
    for minor in minors:
        text = (ROOT / "csrc" / f"compat_py3{minor}.c").read_text()
        head = text[:text.index("*/")]
        # "Audited against CPython v3.13.15" / "Written from CPython v3.12.7's sources"
        assert re.search(rf"CPython v3\.{minor}\.\d+", head), f"compat_py3{minor}.c"
        assert f"#ifdef NNS_PY3{minor}" in text
    # anything past the audited versions stops the build
    tail = compat_h[compat_h.index("NNS_PY314 1"):]
    assert re.search(r"#else\s*\n#\s*error", tail)
