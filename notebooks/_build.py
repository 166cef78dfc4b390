"""Write the notebooks of this folder from the cell lists below (outputs stripped).

    python notebooks/_build.py            # rewrites notebooks/NN_*.ipynb

Each notebook is a list of ("md" | "code", source) cells; edit here, then rebuild.
`tests/test_notebooks.py` executes every notebook headless.
"""
from __future__ import annotations

import os
import sys

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _cells_engine import NOTEBOOKS as ENGINE  # noqa: E402
from _cells_moe import NOTEBOOKS as MOE  # noqa: E402
from _cells_quant import NOTEBOOKS as QUANT  # noqa: E402
from _cells_seams import NOTEBOOKS as SEAMS  # noqa: E402
from _cells_tuning import NOTEBOOKS as TUNING  # noqa: E402

NOTEBOOKS = {**ENGINE, **TUNING, **SEAMS, **QUANT, **MOE}


def build(name: str, cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for kind, src in cells:
        src = src.strip("\n")
        nb.cells.append(nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src))
    for i, cell in enumerate(nb.cells):  # stable ids: rebuilding gives the same file
        cell["id"] = f"{name[:2]}-{i:02d}"
    nbformat.validate(nb)
    return nb


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        path = os.path.join(HERE, f"{name}.ipynb")
        nbformat.write(build(name, cells), path)
        print(f"wrote {path} ({len(cells)} cells)")


if __name__ == "__main__":
    main()
