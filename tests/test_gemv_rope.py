"""The one-row q/k/v GEMV with RMSNorm before and rotary + KV-cache write after
(`kernels.gemv_rope`), against the unfused references; CPU cases under Triton's interpreter."""

import pytest
import torch

pytest.importorskip("triton")

from test_triton_kernels import CPU, GPU, _check_close, _dtypes  # noqa: E402  (same parametrization)

from atom.model_ops.kernels.gemv_rope import gemv_norm_rope, gemv_norm_rope_ref  # noqa: E402


def _case(device, dtype, K, hq, hkv, D, block_size=16, num_blocks=3, g=None):
    N = (hq + 2 * hkv) * D
    x = torch.randn(1, K, generator=g).to(device, dtype)
    res = torch.randn(1, K, generator=g).to(device, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    ang = torch.arange(64.0)[:, None] * (1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))[None, :]
    cs = torch.cat([ang.cos(), ang.sin()], dim=-1).to(device)  # fp32 [64, D], like RotaryEmbedding
    cache = torch.full((num_blocks, block_size, hkv, D), float("nan"), dtype=dtype, device=device)
    return x, res, nw, w, cs, cache


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("K,hq,hkv,D,block_n", [(96, 4, 2, 16, 2), (64, 2, 2, 32, 4), (200, 6, 2, 16, 2),
                                                 (64, 5, 3, 8, 16)])  # programs across heads, a partial last one
def test_gemv_norm_rope(device, K, hq, hkv, D, block_n):
    """q comes out rotated; k (rotated) and v land in the caches at the slot, nothing else
    in the caches is touched; the residual sum is exact; pairs of rows per program (2 or 4)."""
    if device == "cuda" and D > 8:
        K, hq, hkv, D = K * 16, hq * 4, hkv * 2, 128
    g = torch.Generator().manual_seed(K + D)
    for dtype in _dtypes(device):
        x, res, nw, w, cs, cache = _case(device, dtype, K, hq, hkv, D, g=g)
        pos = torch.tensor([37], device=device)
        slot = torch.tensor([21], device=device)  # block 1, offset 5
        cfg = dict(BLOCK_N=block_n, BLOCK_K=64, num_warps=4, num_stages=2, AHEAD=True)
        for r in (res, None):
            kc, vc = cache.clone(), cache.clone()
            y, new_res = gemv_norm_rope(x, r, nw, 1e-6, w, D, hq * D, pos, cs, kc, vc, slot, cfg)
            kr, vr = cache.clone(), cache.clone()
            y_ref, res_ref = gemv_norm_rope_ref(x, r, nw, 1e-6, w, D, hq * D, pos, cs, kr, vr, slot)
            what = f"{dtype} residual={r is not None}"
            _check_close(y[:, :hq * D], y_ref[:, :hq * D], dtype, f"q {what}")
            _check_close(kc[1, 5], kr[1, 5], dtype, f"k cache {what}")
            _check_close(vc[1, 5], vr[1, 5], dtype, f"v cache {what}")
            untouched = torch.ones(cache.shape[:2], dtype=torch.bool)
            untouched[1, 5] = False
            assert kc[untouched].isnan().all() and vc[untouched].isnan().all()
            assert torch.equal(new_res, res_ref)


@pytest.mark.parametrize("device", [CPU])
def test_gemv_norm_rope_padding_slot_and_bad_shapes(device):
    """A negative slot (graph padding) writes no cache entry; a weight that is not [q | k | v]
    heads and an odd BLOCK_N are refused."""
    x, res, nw, w, cs, cache = _case(device, torch.float32, 64, 2, 1, 16, g=torch.Generator().manual_seed(0))
    kc, vc = cache.clone(), cache.clone()
    pos, slot = torch.tensor([3]), torch.tensor([-1])
    y, _ = gemv_norm_rope(x, res, nw, 1e-6, w, 16, 32, pos, cs, kc, vc, slot)
    assert kc.isnan().all() and vc.isnan().all() and not y.isnan().any()
    with pytest.raises(ValueError, match="not \\[q"):
        gemv_norm_rope(x, res, nw, 1e-6, w[:-16], 16, 32, pos, cs, kc, vc, slot)
    with pytest.raises(ValueError, match="BLOCK_N must be even"):
        gemv_norm_rope(x, res, nw, 1e-6, w, 16, 32, pos, cs, kc, vc, slot,
                       dict(BLOCK_N=1, BLOCK_K=64, num_warps=4, num_stages=2, AHEAD=True))
