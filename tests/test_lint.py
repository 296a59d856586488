"""Source checks: version tests only in the version layer (compat/); C headers state
ownership; the C files include each other one way; nnscaler_eval does not import the
public `nnscaler` package built on it."""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# compat/: the version layer, below both the shim (csrc/) and the guards (guards/).
C_DIRS = ("compat", "csrc", "guards")
C_FILES = sorted(p for d in C_DIRS for pattern in ("*.[ch]", "*.cpp")
                 for p in (ROOT / d).glob(pattern))
COMPAT = ROOT / "compat"


def in_compat(path: pathlib.Path) -> bool:
    return path.parent == COMPAT


def test_py_version_hex_only_in_the_version_header():
    """CPython versions are told apart in one place, compat/compat_versions.h; the
    rest of the layer tests the names it defines."""
    offenders = [p.name for p in C_FILES
                 if "PY_VERSION_HEX" in p.read_text() and p != COMPAT / "compat_versions.h"]
    assert offenders == []


def test_version_names_tested_only_in_the_version_layer():
    """The shim and the guards reach version differences through the layer's names
    (nns_*, NNS_DICT_TAGS_MONOTONIC), never by testing the version themselves."""
    pattern = re.compile(r"#\s*(?:if|ifdef|ifndef|elif)\b[^\n]*\bNNS_PY(?:3\d+|_MINOR)\b")
    offenders = sorted(p.name for p in C_FILES
                       if not in_compat(p) and pattern.search(p.read_text()))
    assert offenders == []


def test_internal_cpython_headers_only_in_per_version_files():
    offenders = [p.name for p in C_FILES
                 if re.search(r"#\s*include\s*<internal/", p.read_text())
                 and not (in_compat(p) and re.match(r"compat_py3\d+\.c$", p.name))]
    assert offenders == []


def _code_only(text: str) -> str:
    """C source without comments and string literals."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def test_private_cpython_api_only_behind_the_compat_layer():
    """CPython's private names (`_Py...`) and thread-state fields change between
    minor versions: only the version layer (compat/) may touch them."""
    private = re.compile(r"\b_Py[A-Za-z]\w*|\b(?:ts|tstate)->\w+")
    offenders = {p.name: sorted(set(private.findall(_code_only(p.read_text()))))
                 for p in C_FILES if not in_compat(p)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_private_api_check_sees_what_it_looks_for():
    sample = "x = _PyType_Lookup(t, n); /* _PyNot in a comment */ y = ts->id; s = \"_PyStr\";"
    found = re.findall(r"\b_Py[A-Za-z]\w*|\b(?:ts|tstate)->\w+", _code_only(sample))
    assert found == ["_PyType_Lookup", "ts->id"]


def _folder_of_header(name: str) -> str:
    """The folder of ours holding header `name` ("" for one of CPython's)."""
    return next((d for d in C_DIRS if (ROOT / d / name).exists()), "")


def _includes_by_folder(folder: str) -> dict[str, set[str]]:
    """{file in `folder`: {"folder/header" for each header of ours it includes}}."""
    return {p.name: {f"{_folder_of_header(h)}/{h}" for h in _project_includes(p)
                     if _folder_of_header(h)}
            for p in C_FILES if p.parent.name == folder}


def test_guards_depend_only_on_their_own_headers_and_the_version_layer():
    """Data flows one way (shim -> guards -> cache): guards/ includes its own
    headers, guard_env.h's objects and the object-level version layer
    (compat/compat_objects.h), never the shim's headers (csrc/), not even
    compat.h's frame and bytecode internals."""
    allowed_compat = {"compat/compat_objects.h"}
    offenders = {name: bad for name, headers in _includes_by_folder("guards").items()
                 for bad in [sorted(h for h in headers if not h.startswith("guards/")
                                    and h not in allowed_compat)] if bad}
    assert offenders == {}


def test_the_version_layer_depends_on_nothing_above_it():
    """compat/ is below both csrc/ and guards/: its files include only each other."""
    offenders = {name: bad for name, headers in _includes_by_folder("compat").items()
                 for bad in [sorted(h for h in headers if not h.startswith("compat/"))] if bad}
    assert offenders == {}


# Headers with no source file of their own name: the version layer's (compat/compat.h
# and its object-level half compat_objects.h, whose functions are in compat/*.c, and
# compat_versions.h), and call_key_format.h, definitions only (the bytes of a key,
# shared by its encoder and its reader).  Every file may use them; they are not nodes
# of the graph below.  A new header without a same-named source must be added here.
LAYER_HEADERS = {"compat.h", "compat_objects.h", "compat_versions.h", "call_key_format.h"}


def test_the_design_lists_every_c_file():
    """docs/design.md's table of files names every C source and every header
    without one, by its path."""
    design = (ROOT / "docs" / "design.md").read_text()
    missing = [f"{p.parent.name}/{p.name}" for p in C_FILES
               if (p.suffix in (".c", ".cpp") or p.name in LAYER_HEADERS)
               and f"`{p.parent.name}/{p.name}`" not in design]
    assert missing == []


def test_the_design_lists_every_python_file():
    """docs/design.md's table of Python files names every module of the package by its
    path (a folder's `__init__.py` may be left out: it says what its folder holds)."""
    design = (ROOT / "docs" / "design.md").read_text()
    package = ROOT / "nnscaler_eval"
    missing = [str(p.relative_to(ROOT)) for p in sorted(package.rglob("*.py"))
               if p.name != "__init__.py" and f"`{p.relative_to(ROOT)}`" not in design]
    assert missing == []


def _project_includes(path: pathlib.Path) -> set[str]:
    return set(re.findall(r'^\s*#\s*include\s*"([^"]+)"', path.read_text(), re.M))


def include_graph(files: dict[str, set[str]]) -> dict[str, set[str]]:
    """File-level dependency graph of the sources in `files` ({file name: the names
    in its #include "..." lines}, headers included): "X.c uses Y.h, which Y.c (or
    Y.cpp) defines" is an edge X.c -> Y.c, through headers that include headers.
    Headers without a same-named source (the layers) give no edge."""
    sources = {name for name in files if name.endswith((".c", ".cpp"))}
    defined_by = {name.rsplit(".", 1)[0] + ".h": name for name in sources}
    graph = {}
    for name in sources:
        seen, todo = set(), list(files[name])
        while todo:
            header = todo.pop()
            if header not in seen:
                seen.add(header)
                todo += files.get(header, ())
        graph[name] = {defined_by[h] for h in seen if h in defined_by} - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of `graph` as [a, b, ..., a], or [] when it is acyclic."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def _c_include_graph() -> dict[str, set[str]]:
    return include_graph({p.name: _project_includes(p) for p in C_FILES})


def test_c_files_depend_on_each_other_one_way():
    """Data flows one way (wrapper -> C shim -> guards -> cache -> backend): the
    sources' includes of each other's headers form no cycle, module.c is the root
    (nothing uses it but through the layer headers), and only module.c uses the
    hook's file; arming depends on no other file."""
    files = {p.name: _project_includes(p) for p in C_FILES}
    headers = {name for name in files if name.endswith(".h")}
    sources = {name.rsplit(".", 1)[0] for name in files if not name.endswith(".h")}
    assert {h for h in headers if h[:-2] not in sources} == LAYER_HEADERS
    graph = include_graph(files)
    assert find_cycle(graph) == []
    users = lambda target: sorted(n for n, deps in graph.items() if target in deps)
    assert users("module.c") == []
    assert users("eval_frame.c") == ["module.c"]
    assert graph["arming.c"] == set()


def test_the_include_graph_check_finds_cycles():
    files = {"a.c": {"a.h", "b.h"}, "a.h": {"compat.h"}, "b.c": {"b.h", "c.h"},
             "b.h": set(), "c.c": {"c.h", "d.h"}, "c.h": set(), "d.h": {"a.h"}}
    graph = include_graph(files)
    # c.c reaches a.h through d.h, a header without a source of its own
    assert graph == {"a.c": {"b.c"}, "b.c": {"c.c"}, "c.c": {"a.c"}}
    assert find_cycle(graph) == ["a.c", "b.c", "c.c", "a.c"]
    files["d.h"] = set()
    assert find_cycle(include_graph(files)) == []


# What a header says of a returned object: whose reference the caller gets.
OWNERSHIP_WORDS = re.compile(r"\b(new reference|borrowed|steals?|stolen|ownership)\b", re.I)
RETURNS_OBJECT = re.compile(r"(?m)^(?:static inline )?(?:const )?"
                            r"(?:PyObject|\w+Object|CacheEntry|CacheBucket|CacheTable)"
                            r"\s*\*+\s*\n?(\w+)\(")


def unstated_ownership(text: str) -> list[str]:
    """Functions a header declares returning an object pointer whose comment does not
    say whose reference it is.  A declaration's comment is the comments of its
    paragraph (declarations sharing one comment sit together); an "Ownership:" rule
    in the header's opening comment covers all of them."""
    body = text[text.find("#ifndef"):]
    if re.search(r"(?i)\bownership:", text[:len(text) - len(body)]):
        return []
    found = []
    for paragraph in re.split(r"\n\s*\n", body):
        names = RETURNS_OBJECT.findall(paragraph)
        comments = " ".join(re.findall(r"/\*.*?\*/", paragraph, re.S))
        if names and not OWNERSHIP_WORDS.search(re.sub(r"\s*\n\s*\*?\s*", " ", comments)):
            found += names
    return found


def test_headers_state_the_ownership_of_what_they_return():
    """Every function a header declares that returns an object says whether the
    caller gets a new or a borrowed reference: each C function's contract on
    references is written in its header."""
    offenders = {p.name: names for p in C_FILES if p.suffix == ".h"
                 for names in [unstated_ownership(p.read_text())] if names}
    assert offenders == {}


def test_the_ownership_check_sees_what_it_looks_for():
    text = ("/* x.h */\n#ifndef X\n\n/* A list of the items.  New\n * reference. */\n"
            "PyObject *items(void);\n\n/* The first item. */\nPyObject *\nfirst(void);\n\n"
            "/* Two at once: borrowed. */\nCacheEntry *a(void);\nCacheEntry *b(void);\n"
            "int count(void);\n#endif\n")
    assert unstated_ownership(text) == ["first"]
    assert unstated_ownership("/* x.h\n * Ownership: borrowed. */\n#ifndef X\n"
                              "PyObject *first(void);\n#endif\n") == []


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
    compat_h = (COMPAT / "compat_versions.h").read_text()   # the version tests
    minors = sorted(int(m) for m in re.findall(r"#\s*define NNS_PY3(\d+) 1", compat_h))
    assert minors == [11, 12, 13, 14]
    for minor in minors:
        text = (COMPAT / f"compat_py3{minor}.c").read_text()
        head = text[:text.index("*/")]
        # "Audited against CPython v3.13.15"
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
    "nnscaler_eval/tools/demo.py":
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


def _with_lock_statements(source: str) -> list[tuple[int, str]]:
    """`with <something named ...lock...>:` statements (AST, any nesting)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.With, ast.AsyncWith)):
            continue
        for item in node.items:
            expr = item.context_expr
            name = expr.id if isinstance(expr, ast.Name) else \
                expr.attr if isinstance(expr, ast.Attribute) else None
            if name is not None and "lock" in name.lower():
                found.append((node.lineno, name))
    return found


def test_the_with_lock_check_sees_every_form():
    source = ("with _lock:\n    pass\nwith state.capture_lock, open('f'):\n    pass\n"
              "def f():\n    with other, self._Lock as held:\n        pass\n"
              "with open('x') as block:\n    pass\n")
    assert [name for _, name in _with_lock_statements(source)] == [
        "_lock", "capture_lock", "_Lock"]


def test_no_with_lock_statements():
    # `with lock:` is not interrupt-safe on 3.13+: a KeyboardInterrupt from the
    # periodic check at the end of the CALL of __enter__ leaves the lock held (csrc/
    # held_lock.h).  Locks are held through _C.call_holding instead.
    offenders = []
    for path in sorted((ROOT / "nnscaler_eval").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        offenders += [f"{rel}:{line} with {name}:"
                      for line, name in _with_lock_statements(path.read_text())]
    assert offenders == [], "hold locks through nnscaler_eval._C.call_holding"


def external_definitions(text: str) -> list[str]:
    """Names a C source defines with external linkage: functions whose name starts a
    line after a return-type line that is not `static` (the house style), and
    file-scope variables that are neither static, extern nor typedefs."""
    lines = text.splitlines()
    found: list[str] = []
    for i, line in enumerate(lines):
        function = re.match(r"^([A-Za-z_]\w*)\s*\(", line)
        if function and i > 0 and not lines[i - 1].startswith(("static", "#", "/*", " ")) \
                and lines[i - 1].strip() and not lines[i - 1].rstrip().endswith((";", "}")):
            j = i
            while j < len(lines) and not lines[j].rstrip().endswith((")", "{", ";")):
                j += 1
            if j + 1 < len(lines) and not lines[j].rstrip().endswith(";"):
                found.append(function.group(1))
        variable = re.match(
            r"^(?!static\b|extern\b|typedef\b|return\b|struct\s+\w+\s*;)[A-Za-z_][\w\s\*]*?"
            r"\b([A-Za-z_]\w*)\s*(=[^;]*)?;\s*$", line)
        if variable and "(" not in line:
            found.append(variable.group(1))
    return [n for n in found if not n.startswith("PyInit_")]


def test_each_source_defines_only_what_its_own_header_declares():
    """Definition-level layering, which includes alone cannot see: a file that
    defines what another file's header declares (module.c defining nns_globals)
    makes every user of that header depend on it, a cycle through the root.  So a
    source's external names are declared in its own header (the version layer's
    sources, compat/*.c: compat.h and compat_objects.h)."""
    offenders = {}
    for path in C_FILES:
        if path.suffix not in (".c", ".cpp"):
            continue
        headers = ([COMPAT / "compat.h", COMPAT / "compat_objects.h"]
                   if in_compat(path) else [path.with_suffix(".h")])
        declared = "".join(h.read_text() for h in headers if h.exists())
        missing = [n for n in external_definitions(path.read_text())
                   if not re.search(rf"\b{n}\b", declared)]
        if missing:
            offenders[path.name] = missing
    assert offenders == {}


def test_the_definition_check_sees_functions_and_variables():
    text = ("static int\nhidden(void)\n{\n}\n\nint\nshown(int x)\n{\n}\n"
            "Thing thing = {0};\nstatic Thing kept;\nextern Thing elsewhere;\n"
            "int declared(void);\ntypedef int alias;\n")
    assert external_definitions(text) == ["shown", "thing"]
