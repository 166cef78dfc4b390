"""The kernel sweep scripts' grids and arguments, without a GPU: `quant_gemv_sweep.py --wide`
(the M = 1 grid behind the swap-AB decode tiles), `moe_offsets_sweep.py`, `moe_route_sweep.py`,
and `attention_bs1_sweep.py` (the engine's batch-1 decode attention call it times)."""
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


@pytest.mark.parametrize("splits, cfg", [(None, None), (4, dict(TILE_N=16, num_warps=2)), (1, dict(TILE_N=32)),
                                         (None, dict(skip_empty=True)), (32, None),
                                         (4, dict(TILE_N=16, rows_ahead=True, num_stages=3))])
def test_attention_bs1_sweep_times_the_engines_decode_call(splits, cfg):
    """The call the batch-1 attention sweep times is the engine's decode step: on a copy of its
    caches (fp16 here: the interpreter's bf16 dots are wrong) the output equals the rotary
    embedding with its cache write followed by paged attention, and the cache gets this step's
    rotated k and v, whatever the splits and tiles."""
    from atom.model_ops.attention.triton_unified import AttentionWorkspace, paged_attention_ref
    from atom.model_ops.kernels import rotary_embedding_ref
    sweep = _script("attention_bs1_sweep")
    ctx = 40
    steps, s = sweep.step_copies(ctx, torch.device("cpu"), torch.float16)
    assert len(steps) >= 2 and s["bytes"] == 2 * 3 * sweep.BS * sweep.HKV * sweep.D * 2
    kc, vc, bt, slot = steps[0]
    want_k, want_v = kc.clone(), vc.clone()
    q_ref, k_ref = s["q"].reshape(1, -1).clone(), s["k"].reshape(1, -1).clone()
    rotary_embedding_ref(torch.tensor([ctx - 1]), q_ref, k_ref, s["cs"], sweep.D, None, None, 1e-6,
                         kv_cache=(s["v"].reshape(1, -1), want_k, want_v, slot))
    ref = paged_attention_ref(q_ref.view(1, sweep.HQ, sweep.D), want_k, want_v, torch.empty_like(s["q"]),
                              cu_seqlens_q=s["cu"], seq_lens=s["sl"], block_tables=bt,
                              softmax_scale=sweep.D ** -0.5, max_query_len=1)
    out = torch.full_like(s["q"], float("nan"))
    ws = AttentionWorkspace(1, sweep.HQ, sweep.D, max_splits=max(16, splits or 1))
    ws.partial_lse.fill_(float("nan"))
    sweep.engine_call(s, steps[0], out, ws, cfg, splits)
    if splits and splits > 1:  # the segments ran: each segment's log-sum-exp written
        assert not ws.partial_lse[0, :, :splits].isnan().any()
    assert (out.float() - ref.float()).abs().max() < 2e-3
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_attention_bs1_sweep_says_it_needs_a_gpu(capsys):
    sweep = _script("attention_bs1_sweep")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert sweep.main(["--out", "unused.json"]) == 2
    assert "nothing was timed" in capsys.readouterr().err
