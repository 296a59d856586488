"""Where the user is: the `file:line` a node, a fallback or a side effect comes from.

A frame belongs to the user unless its file is under torch, under nnscaler_eval (this
package included), or in the standard library; third-party packages under the
interpreter's lib dir are the user's models.  Below the capture, state_guards and
trace_patches, which all ask it.
"""

from __future__ import annotations

import contextlib
import linecache
import importlib.util
import os
import sys

import torch
import torch.fx as fx

from nnscaler_eval.shared_objects import INTERNAL_PREFIX



def _package_dir(name: str) -> tuple[str, ...]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return ()
    return tuple(os.path.join(path, "") for path in spec.submodule_search_locations)


_PACKAGE_DIRS = (
    os.path.join(os.path.dirname(torch.__file__), ""),
    INTERNAL_PREFIX,  # the whole nnscaler_eval directory, not only capture/
    # torch's symbolic-shape engine: a dynamic capture (capture/dynamic.py) runs it
    # inside the forward, on symbols only; it reads no user state.
    *_package_dir("sympy"),
    *_package_dir("mpmath"),
    # Test harnesses: never the user's model.  Their objects (pytest's log capture
    # handler and its list of records) are library state, guarded only for what
    # user code reads of them.
    *_package_dir("_pytest"),
    *_package_dir("pluggy"),
)
_STDLIB_DIR = os.path.join(os.path.dirname(contextlib.__file__), "")


def is_library_file(filename: str) -> bool:
    if filename.startswith("<"):
        return filename.startswith(("<frozen", "<nnscaler graph"))
    if filename.startswith(_PACKAGE_DIRS):
        return True
    # Third-party packages under the interpreter's lib dir are the user's models.
    return filename.startswith(_STDLIB_DIR) and "-packages" not in filename


def user_location() -> tuple[str, int]:
    """The innermost frame outside torch, nnscaler_eval and the standard library."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library_file(filename):
            return filename, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>", 0


def record_source(node: fx.Node) -> None:
    """Tag `node` with the user's line that produced it.

    `nnscaler_source` (filename, lineno) for the runner's comments; `source_loc`
    ("file:line") and `stack_trace` (one traceback entry, the format torch.fx and
    Dynamo use) for exported graphs and fx's own printing.
    """
    frame = sys._getframe(1)
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        node.meta["nnscaler_source"] = ("<unknown>", 0)
        return
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    node.meta["nnscaler_source"] = (filename, lineno)
    node.meta["source_loc"] = f"{filename}:{lineno}"
    line = linecache.getline(filename, lineno).strip()
    node.meta["stack_trace"] = (
        f'  File "{filename}", line {lineno}, in {frame.f_code.co_name}\n'
        + (f"    {line}\n" if line else "")
    )
