"""The kernel sweep scripts' grids and arguments, without a GPU: `quant_gemv_sweep.py --wide`
(the M = 1 grid behind the swap-AB decode tiles), `moe_offsets_sweep.py`, and `moe_route_sweep.py`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("N,K,block_k", [(4096, 14336, 0), (6144, 4096, 0), (28672, 4096, 0), (4096, 4096, 128)])
def test_wide_grid_holds_the_table_tiles_and_keeps_its_bounds(N, K, block_k):
    from atom.model_ops.kernels.quant_gemv_dot import small_m_config
    sweep = _script("quant_gemv_sweep")
    grid = sweep.wide_grid(1, N, K, block_k, 16)
    assert 10 <= len(grid) <= 60
    for c in grid:
        bk = c["BLOCK_K"]
        assert (K // bk) // c["SPLIT_K"] >= 2 and 132 <= -(-N // c["BLOCK_N"]) * c["SPLIT_K"] <= 1056
        assert c["BLOCK_N"] * bk * c["num_stages"] <= 128 << 10 or c["num_stages"] == 2
        assert c["num_warps"] == (8 if c["BLOCK_N"] >= 128 else 4) and not c["FUSE"]
        assert bk == block_k if block_k else bk in (128, 256, 512)
    table = small_m_config(1, N, K, block_k)
    keys = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
    full = sweep.dot_grid(1, N, K, block_k, False, wide=True)  # what `--wide` times: the table's tile first
    assert all(c in full for c in grid) and any(all(c[k] == table[k] for k in keys) for c in full), table


def test_quant_gemv_sweep_refuses_bad_shapes_before_anything_runs(capsys):
    sweep = _script("quant_gemv_sweep")
    with pytest.raises(SystemExit):
        sweep.main(["--out", "x.json", "--kinds", "fp8dot", "--shapes", "4096x0"])
    assert "--shapes ['4096x0']: each must be NxK" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_moe_offsets_sweep_says_it_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        _script("moe_offsets_sweep").main()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_moe_route_sweep_says_it_needs_a_gpu(monkeypatch):
    monkeypatch.setattr("sys.argv", ["moe_route_sweep.py", "--out", "unused.json"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        _script("moe_route_sweep").main()
