"""Functions a notebook writes on its page, run by the tests and benchmarks as the page
writes them (not a copy that could drift from it)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def page_cell(notebook: str, starts: str) -> str:
    """The source of the one code cell of ``notebooks/<notebook>`` that starts with
    ``starts``."""
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    (source,) = [
        "".join(c["source"])
        for c in cells
        if c["cell_type"] == "code" and "".join(c["source"]).startswith(starts)
    ]
    return source


def page_function(notebook: str, name: str, **names):
    """The function ``name`` that a code cell of ``notebooks/<notebook>`` defines, compiled
    alone (the rest of its cell not run), with ``names`` as its globals."""
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        tree = ast.parse("".join(cell["source"]))
        found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
        if found:
            namespace = dict(names)
            exec(compile(ast.Module(found, []), notebook, "exec"), namespace)
            return namespace[name]
    raise LookupError(f"no code cell of {notebook} defines {name}()")
