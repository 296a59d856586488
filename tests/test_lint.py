"""Source checks: version tests only in the compat files; C headers state ownership;
nnscaler_eval does not import the public `nnscaler` package built on it."""
from __future__ import annotations

import ast
import importlib.util
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


def _code_only(text: str) -> str:
    """C source without comments and string literals."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def test_private_cpython_api_only_behind_the_compat_layer():
    """CPython's private names (`_Py...`) and thread-state fields change between
    minor versions: only compat.h and compat_*.c may touch them."""
    private = re.compile(r"\b_Py[A-Za-z]\w*|\b(?:ts|tstate)->\w+")
    offenders = {p.name: sorted(set(private.findall(_code_only(p.read_text()))))
                 for p in C_FILES if not p.name.startswith("compat")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_private_api_check_sees_what_it_looks_for():
    sample = "x = _PyType_Lookup(t, n); /* _PyNot in a comment */ y = ts->id; s = \"_PyStr\";"
    found = re.findall(r"\b_Py[A-Za-z]\w*|\b(?:ts|tstate)->\w+", _code_only(sample))
    assert found == ["_PyType_Lookup", "ts->id"]


def test_guards_depend_only_on_their_own_headers_and_the_version_layer():
    """Data flows one way (shim -> guards -> cache): guards/ includes its own
    headers, guard_env.h's objects and compat.h, never the shim's headers."""
    own = {p.name for p in (ROOT / "guards").glob("*.h")}
    allowed = own | {"compat.h", "structmember.h"}
    offenders = {p.name: bad for p in C_FILES if p.parent.name == "guards"
                 for bad in [sorted(set(re.findall(r'#\s*include\s*"([^"]+)"', p.read_text()))
                                    - allowed)] if bad}
    assert offenders == {}


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


# The public `nnscaler` package is built on nnscaler_eval (nnscaler_eval/_nnscaler/, or
# our names added onto Microsoft nnScaler's package), so nnscaler_eval imports its own
# names from nnscaler_eval. These may import `nnscaler`, each for the reason given:
NNSCALER_IMPORTERS = {
    "nnscaler_eval/_nnscaler/":
        "the public package itself: what `import nnscaler` gives without Microsoft nnScaler",
    "nnscaler_eval/microsoft_nnscaler.py":
        "the one place Microsoft nnScaler's own modules are imported, by paths only its "
        "distribution has",
    "nnscaler_eval/demo.py":
        "a user program (`make demo`) written as users write it; nothing imports it",
}


def _nnscaler_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of `nnscaler` or `nnscaler.*` in `source`:
    import statements and import_module() / __import__() calls with a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and node.args
              and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
              in ("import_module", "__import__")
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        else:
            continue
        found += [(node.lineno, name) for name in names
                  if name == "nnscaler" or name.startswith("nnscaler.")]
    return found


def test_the_nnscaler_import_check_sees_every_form():
    source = ("import nnscaler\nimport nnscaler_eval\nfrom nnscaler.runtime import function\n"
              "from nnscaler_eval import api\nimportlib.import_module('nnscaler.graph')\n"
              "def f():\n    import nnscaler.graph.parser as p\n")
    assert [name for _, name in _nnscaler_imports(source)] == [
        "nnscaler", "nnscaler.runtime", "nnscaler.graph", "nnscaler.graph.parser"]


def test_nnscaler_eval_does_not_import_the_public_nnscaler_package():
    for allowed in NNSCALER_IMPORTERS:
        assert (ROOT / allowed).exists(), f"stale allow-list entry {allowed}"
    offenders = []
    for path in sorted((ROOT / "nnscaler_eval").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(tuple(NNSCALER_IMPORTERS)):
            continue
        offenders += [f"{rel}:{line} imports {name}"
                      for line, name in _nnscaler_imports(path.read_text())]
    assert offenders == [], ("take our names from nnscaler_eval, and Microsoft nnScaler's "
                             "modules through nnscaler_eval.microsoft_nnscaler")


def test_microsoft_nnscaler_names_only_modules_our_public_package_lacks():
    """Each path it imports exists in Microsoft's distribution only: with nnScaler
    absent it fails instead of quietly importing a module of ours."""
    path = ROOT / "nnscaler_eval" / "microsoft_nnscaler.py"
    spec = importlib.util.spec_from_file_location("_microsoft_nnscaler_lint", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)   # imports only importlib and types
    ours = ROOT / "nnscaler_eval" / "_nnscaler"
    for name in module.MODULES:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            stem = ours.joinpath(*parts[:depth])
            if not (stem.is_dir() or stem.with_suffix(".py").exists()):
                break
        else:
            raise AssertionError(f"nnscaler.{name} is a module of our public package too")
