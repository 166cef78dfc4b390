"""Every notebook of notebooks/ runs headless, top to bottom, without an error.

The kernel is this interpreter (jupyter_client maps the `python3` spec's "python" to
`sys.executable`), started in a temporary folder with MPLBACKEND=Agg and the repository on
PYTHONPATH. The notebooks are stored without outputs; this also checks that.
"""
from __future__ import annotations

import os
import pathlib
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_notebooks_exist_and_are_stored_without_outputs():
    names = [p.stem for p in NOTEBOOKS]
    assert names == ["01_quickstart", "02_config_and_cli", "03_block_manager_prefix_cache",
                     "04_scheduler_chunked_prefill", "05_quantization_dispatch",
                     "06_cuda_graph_capture_sizes", "07_benchmark_roofline", "08_engine_parts", "09_quant_sensitivity",
                     "10_moe_routing"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"
        asserts = sum("assert " in c.source for c in nb.cells if c.cell_type == "code")
        assert asserts >= 3, f"{path.name}: only {asserts} cells check results"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the cell on the first error
    wall = time.perf_counter() - t0
    print(f"{path.name}: {wall:.1f} s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
