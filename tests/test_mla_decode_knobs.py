"""The launch knobs of the absorbed MLA decode kernel (`atom.model_ops.kernels.mla_decode`):
pipeline stages, page-wise block-table loads, grid order, splits by work, the split table and
the workspace sized from it. Every knob is checked against `mla_torch.latent_decode_ref` on tiny
shapes (Triton interpreter on CPU)."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from atom.model_ops.attention.mla_torch import latent_decode_ref

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

R, P = 32, 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU, the kernel on a GPU


def _batch(lens, heads=5, block_size=8, seed=0, dtype=torch.float32):
    """Random latent cache in shuffled pages, its block tables and queries for contexts `lens`."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in lens]
    nb = sum(pages) + 3
    cache = torch.randn(nb, block_size, R + P, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        tables[b, :n] = perm[at:at + n]
        at += n
    ql = torch.randn(len(lens), heads, R, generator=g).to(dtype)
    qp = torch.randn(len(lens), heads, P, generator=g).to(dtype)
    return tuple(t.to(DEV) for t in (ql, qp, cache, tables, torch.tensor(lens, dtype=torch.int32)))


def _ref(ql, qp, cache, tables, lens, scale=0.3):
    return latent_decode_ref(ql.float(), qp.float(), cache.float(), tables, lens.tolist(), scale).to(ql.device)


@pytest.mark.parametrize("cfg,block_size", [
    (dict(TILE_N=16, num_stages=1), 16),                      # one block-table entry a tile
    (dict(TILE_N=16, num_stages=3), 32),                      # a tile inside a bigger page
    (dict(TILE_N=32, num_stages=2, num_warps=2), 8),          # four pages a tile, one entry each
    (dict(TILE_N=16, page_loads=False, num_stages=2), 8),     # one entry a token
    (dict(TILE_N=16, splits_first=False, num_splits=4, min_split_tokens=8), 8),
    (dict(TILE_N=16, splits_first=True, num_splits=4, min_split_tokens=8, num_stages=3), 16),
    (dict(BLOCK_H=16, TILE_N=16, num_splits=2, min_split_tokens=1), 4),
    (dict(TILE_N=16, lazy_rescale=True, page_loads=False), 8),
    (dict(TILE_N=16, lazy_rescale=True, num_splits=4, min_split_tokens=8), 8),
])
def test_knobs_match_reference(cfg, block_size):
    ql, qp, cache, tables, lens = _batch([37, 1, 16, 70], block_size=block_size)
    out = mla_decode_call(ql, qp, cache, tables, lens, config=cfg)
    torch.testing.assert_close(out, _ref(ql, qp, cache, tables, lens), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_late_large_score_moves_the_running_max(lazy):
    """Scores that jump by far more than 2^8 (log2 units) in a late tile: the lazy rescale must
    then move the max and rescale what it has summed (else exp2 overflows or loses the tile)."""
    ql, qp, cache, tables, lens = _batch([70, 45], block_size=8)
    for b, t in ((0, 60), (1, 20)):  # a latent row that matches its queries strongly
        page, off = tables[b, t // 8].item(), t % 8
        cache[page, off, :R] = ql[b].float().mean(0).to(cache.dtype) * 60  # ~165 log2 units: past fp32 exp2 without a rescale
    ref = _ref(ql, qp, cache, tables, lens)
    out = mla_decode_call(ql, qp, cache, tables, lens,
                          config=dict(TILE_N=16, lazy_rescale=lazy, num_splits=1))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def mla_decode_call(ql, qp, cache, tables, lens, **kw):
    from atom.model_ops.kernels.mla_decode import mla_decode
    return mla_decode(ql, qp, cache, tables, lens, R, 0.3, **kw)


def test_half_precision_with_stages_and_pages_matches_reference():
    """fp16 here: the interpreter computes bf16 wrongly (also before these knobs); the GPU test
    of tests/test_mla.py runs the bf16 cache."""
    ql, qp, cache, tables, lens = _batch([45, 9, 64], heads=20, block_size=16, dtype=torch.float16, seed=3)
    out = mla_decode_call(ql, qp, cache, tables, lens,
                          config=dict(TILE_N=32, num_stages=3, num_splits=4, min_split_tokens=16))
    torch.testing.assert_close(out.float(), _ref(ql, qp, cache, tables, lens), atol=2e-2, rtol=2e-2)


def test_bf16_queries_over_an_fp8_cache_match_reference():
    """bf16 queries over an FP8 latent cache run the dots in fp16 (KV_F16): the fp32 reference
    on the dequantized cache (fp8 x kv_scale) within the bf16 output's rounding, split and
    unsplit, 3 stages."""
    ql, qp, cache, tables, lens = _batch([45, 9, 64, 1], heads=16, block_size=16, seed=4)
    scale = torch.tensor(0.02, device=DEV)
    fp8 = (cache / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    ref = _ref(ql.to(torch.bfloat16).float(), qp.to(torch.bfloat16).float(), fp8.float() * scale, tables, lens)
    for cfg in (dict(TILE_N=16, num_stages=3, num_splits=1), dict(TILE_N=16, num_stages=3, num_splits=4,
                                                                   min_split_tokens=16)):
        out = mla_decode_call(ql.to(torch.bfloat16), qp.to(torch.bfloat16), fp8, tables, lens, config=cfg,
                              kv_scale=scale)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_splits_by_work_use_only_segments_of_min_split_tokens():
    """A sequence uses min(num_splits, ceil(len / min_split_tokens)) segments of whole tiles;
    the unused ones write only lse = -inf (their output rows in the workspace stay untouched,
    the traffic a short sequence saves), and the merged result is the reference's."""
    from atom.model_ops.kernels.mla_decode import MLAWorkspace
    lens_l = [5, 40, 130, 16]
    ql, qp, cache, tables, lens = _batch(lens_l, heads=3, block_size=16, seed=1)
    ws = MLAWorkspace(4, 3, R, max_splits=8, device=DEV)
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    out = mla_decode_call(ql, qp, cache, tables, lens, workspace=ws,
                          config=dict(TILE_N=16, num_splits=8, min_split_tokens=16))
    torch.testing.assert_close(out, _ref(ql, qp, cache, tables, lens), atol=2e-5, rtol=2e-5)
    po, plse = ws.buffers(4, 3, R, 8)
    for b, n in enumerate(lens_l):
        used = min(8, math.ceil(n / 16))  # segments of >= 16 tokens (here one 16-token tile or more)
        assert torch.isfinite(plse[b, :, :used]).all(), (b, plse[b])
        assert torch.isneginf(plse[b, :, used:]).all(), (b, plse[b])
        assert torch.isfinite(po[b, :, :used]).all()
        assert torch.isnan(po[b, :, used:]).all()  # never written


def test_workspace_too_small_lowers_the_split_count():
    """Slots for fewer (sequence, segment) pairs than asked: the largest power of two that fits
    is used (shapes only), with the reference's result."""
    from atom.model_ops.kernels.mla_decode import MLAWorkspace
    ql, qp, cache, tables, lens = _batch([50, 33], heads=2, block_size=8, seed=2)
    ws = MLAWorkspace(2, 2, R, max_splits=8, slots=4, device=DEV)  # B=2: at most 2 splits
    assert ws.fits(2, 2, R, 2) and not ws.fits(2, 2, R, 4)
    ws.partial_lse.fill_(float("nan"))
    out = mla_decode_call(ql, qp, cache, tables, lens, workspace=ws, config=dict(min_split_tokens=1, TILE_N=16),
                          num_kv_splits=8)
    torch.testing.assert_close(out, _ref(ql, qp, cache, tables, lens), atol=2e-5, rtol=2e-5)
    assert torch.isfinite(ws.partial_lse).all()  # 2 x 2 heads x 2 splits: all four slots' lse written
    assert "slots=4" in repr(ws)


def test_split_table_keeps_programs_per_sm_and_workspace_covers_it():
    from atom.model_ops.kernels.mla_decode import MLAWorkspace, pick_mla_config, workspace_slots
    sms = 132
    for b in (1, 8, 32, 64, 100, 128, 136, 200, 256):
        cfg = pick_mla_config(b, 16, 512, sms)
        progs = b * cfg["num_splits"]
        assert progs >= min(2 * sms, 32 * b) * 0.5, (b, cfg)  # no batch leaves most SMs idle
        assert cfg["num_splits"] & (cfg["num_splits"] - 1) == 0
    assert pick_mla_config(4096, 16, 512, sms)["num_splits"] == 1
    assert pick_mla_config(1, 16, 512, sms, max_splits=6)["num_splits"] == 4  # capped to a power of two
    slots = workspace_slots(512, 16, 512, sms)
    ws = MLAWorkspace(512, 16, 512, max_splits=32, slots=slots)
    for b in range(1, 513):
        s = pick_mla_config(b, 16, 512, sms)["num_splits"]
        assert s == 1 or ws.fits(b, 16, 512, s), b
    assert slots <= 264 * 4  # 4 splits up to 2 x 132 sequences: far below max_num_seqs x max_splits


def test_backend_workspace_follows_the_table():
    from atom.model_ops.attention.mla_triton import TritonMLABackend
    from atom.model_ops.kernels.mla_decode import num_sms, pick_mla_config
    layer = type("L", (), dict(num_heads=16, kv_lora_rank=512))()
    be = TritonMLABackend([layer], max_num_tokens=256)
    ws = be.workspace
    sms = num_sms(None)  # the backend's device (here the CPU: the interpreter splits little)
    splits = {b: pick_mla_config(b, 16, 512, sms)["num_splits"] for b in range(1, 257)}
    assert all(s == 1 or ws.fits(b, 16, 512, s) for b, s in splits.items())
    assert pick_mla_config(1, 16, 512, sms)["num_splits"] <= 4 < pick_mla_config(1, 16, 512)["num_splits"]
    assert ws.nbytes < 64 * 2**20 and "slots=" in repr(be)


@pytest.mark.parametrize("cfg,match", [
    (dict(TILE_N=24), "TILE_N=24"),
    (dict(num_stages=0), "num_stages=0"),
    (dict(min_split_tokens=0), "min_split_tokens=0"),
    (dict(num_warp=4), "unknown keys \\['num_warp'\\]"),
    (dict(num_splits=3), "num_splits=3"),
    (dict(lazy_rescale=1), "lazy_rescale=1"),
])
def test_bad_configs_name_the_field(cfg, match):
    ql, qp, cache, tables, lens = _batch([9], heads=2)
    with pytest.raises(ValueError, match=match):
        mla_decode_call(ql, qp, cache, tables, lens, config=cfg)


def _sweep_script():
    path = __file__.rsplit("/tests/", 1)[0] + "/scripts/mla_decode_sweep.py"
    spec = importlib.util.spec_from_file_location("mla_decode_sweep", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sweep_grid_is_small_valid_and_varies_every_knob():
    """The H200 sweep: <= 30 configurations a case, each one the kernel accepts, together
    touching every knob of CONFIG_KEYS except BLOCK_H (16 heads: one block)."""
    from atom.model_ops.kernels.mla_decode import CONFIG_KEYS, _check_config, pick_mla_config
    sweep = _sweep_script()
    seen = set()
    for b in (1, 8, 32, 64, 128, 256):
        default = pick_mla_config(b, 16, 512)
        for quick, token_rows in ((False, False), (True, False), (False, True)):
            cfgs = sweep.configs(default, quick, token_rows)
            assert 0 < len(cfgs) <= 30
            for c in cfgs:
                _check_config(dict(default, **c))
                assert c != {k: default[k] for k in c}  # never the default again
                seen |= set(c)
    assert seen == set(CONFIG_KEYS) - {"BLOCK_H"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_sweep_says_it_needs_a_gpu(tmp_path, capsys):
    sweep = _sweep_script()
    import sys
    argv = sys.argv
    sys.argv = ["mla_decode_sweep.py", "--out", str(tmp_path / "x.json")]
    try:
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            sweep.main()
    finally:
        sys.argv = argv


def _compile_variants() -> dict:
    """Child process (no interpreter): the decode kernel at DeepSeek-V2-Lite's shape for sm90,
    per (page mode, stages, TILE_N, warps): cp.async copies in its PTX (pipelined loads) and
    the shared-memory buffers of the latent tile in its TTGIR (how many tiles are in flight); the
    FP8 variant over an FP8 latent cache (e4m3 rows, the scale folded in, fp16 dots)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom.model_ops.kernels import mla_decode as m
    k = m._mla_decode_kernel
    types = dict(scale_log2="fp32", po_ptr="*fp32", plse_ptr="*fp32", seq_lens_ptr="*i32", bt_ptr="*i32",
                 kvs_ptr="*fp32")
    # as the launcher specialises them: pointers and the strides of 576-wide rows divisible by 16
    div16 = {a for a in k.arg_names if a.endswith("_ptr") or (a.startswith("stride_") and a != "stride_plh")}
    out = {}
    for mode, stages, tile, warps, fp8 in ((0, 1, 32, 4, False), (0, 3, 32, 8, False), (1, 3, 16, 4, False),
                                           (2, 3, 32, 4, False), (2, 2, 64, 4, False), (2, 3, 32, 4, True),
                                           (0, 3, 32, 4, False), (0, 4, 16, 4, False)):
        cx = dict(NUM_HEADS=16, R=512, P=64, R_PAD=512, P_PAD=64, BLOCK_H=16, TILE_N=tile, BLOCK_SIZE=16,
                  NUM_SPLITS=4, DOT_PREC="tf32", PAGE_MODE=mode, SPLITS_FIRST=True, KV_FP8=fp8, KV_F16=fp8)
        sig = {a: "constexpr" if a in cx else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
               for a in k.arg_names}
        if fp8:
            sig["cache_ptr"] = "*fp8e4nv"
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(k.arg_names) if a in div16}
        c = triton.compile(ASTSource(fn=k, signature=sig, constexprs=cx, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
        ptx = c.asm["ptx"]
        bufs = [int(n) for n in re.findall(rf"memdesc<(\d+)x{tile}x512x", c.asm["ttgir"])]
        out[f"{mode}/{stages}/{tile}/{warps}" + ("/fp8" if fp8 else "")] = dict(
            cp_async="cp.async" in ptx, mma="mma.sync" in ptx, tile_buffers=max(bufs, default=0),
            f16_dots="cvt.rn.f16x2.e4m3x2" in ptx and "cvt.bf16.f16" not in ptx)
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-side PTX check; on a GPU the kernels run")
def test_decode_kernel_compiles_for_sm90_and_stages_pipeline_the_loads():
    import json
    import os
    import subprocess
    import sys
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no ptxas for NVIDIA targets")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_mla_decode_knobs import _compile_variants; "
            "print(json.dumps(_compile_variants()))")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, cwd=root, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(v["mma"] for v in got.values()), got  # the dots on tensor cores in every variant
    assert not got["0/1/32/4"]["cp_async"]  # one stage: plain loads
    for key in ("0/3/32/8", "1/3/16/4", "2/3/32/4", "2/2/64/4", "2/3/32/4/fp8", "0/3/32/4"):
        assert got[key]["cp_async"], (key, got)  # more: copies issued ahead
    # the next tile's rows are found an iteration ahead, so num_stages - 1 latent tiles are in
    # flight (with the block-table load in the same iteration Triton kept one buffer)
    for key, n in (("0/3/32/4", 2), ("0/3/32/8", 2), ("0/4/16/4", 3), ("1/3/16/4", 2)):
        assert got[key]["tile_buffers"] == n, (key, got)
    # bf16 queries over the FP8 latent cache: e4m3 pairs straight to fp16, dots in fp16
    assert got["2/3/32/4/fp8"]["f16_dots"] and not got["0/3/32/4"]["f16_dots"], got


def test_launch_and_sweep_frames():
    from atom.viz.mla_frames import mla_launch_frame, mla_sweep_frame
    df = mla_launch_frame([1, 64, 128, 512])
    assert list(df.batch) == [1, 64, 128, 512] and list(df.num_splits) == [32, 8, 4, 2]
    assert (df.programs_per_sm[:3] >= 0.24).all() and df.workspace_slots.iloc[-1] == 512 * 2
    # batch 1: 64-token tiles, 2 stages (one in flight); from 64 on 32-token tiles, 3 stages (two)
    assert list(df.tiles_in_flight) == [1, 2, 2, 2] and list(df.tiles_kib) == [72.0, 72.0, 72.0, 72.0]
    fake = dict(peak_TBs=4.0, results={"B=1, ctx 512": dict(
        best=[dict(config={"TILE_N": 64}, us=2.0, TBs=2.0)],
        all=[dict(config="default", us=4.0, TBs=1.0), dict(config={"TILE_N": 64}, us=2.0, TBs=2.0),
             dict(config={"TILE_N": 16}, error="OutOfResources")])})
    sf = mla_sweep_frame(fake)
    assert len(sf) == 2 and list(sf.of_peak) == [0.25, 0.5]
    assert list(sf.is_best) == [False, True] and list(sf.is_default) == [True, False]
