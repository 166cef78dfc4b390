"""The linear layers' unquantized method (`dense`: the CPU oneDNN route) against `F.linear`,
and the one-row GEMV choice / fused norm + projection that the kernel plan installs."""
import pytest
import torch
import torch.nn.functional as F

from atom.model_ops.linear import Linear, MergedLinear, QKVLinear, dense


@pytest.mark.parametrize("rows", [0, 1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    torch.testing.assert_close(dense(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_dense_keeps_leading_dims_and_other_dtypes():
    x, w = torch.randn(2, 3, 32), torch.randn(8, 32)
    assert dense(x, w).shape == (2, 3, 8)
    xb, wb = x.bfloat16(), w.bfloat16()  # not fp32: plain F.linear
    assert torch.equal(dense(xb, wb), F.linear(xb, wb))


def test_linear_layers_use_dense():
    lin = MergedLinear(32, [16, 16])
    lin.weight.data.normal_()
    x = torch.randn(5, 32)
    torch.testing.assert_close(lin(x), x @ lin.weight.T, rtol=1e-5, atol=1e-5)
    plain = Linear(32, 4, bias=True)
    plain.weight.data.normal_(); plain.bias.data.normal_()
    torch.testing.assert_close(plain(x), F.linear(x, plain.weight, plain.bias), rtol=1e-5, atol=1e-5)


def test_norm_linear_is_norm_then_linear():
    """Off the fused path (CPU, or no measured choice) `norm_linear` is the layers in order."""
    from atom.model_ops.activation import silu_and_mul_ref
    from atom.model_ops.norm import RMSNorm
    from atom.tuning.fusions import norm_linear
    norm, lin = RMSNorm(32), MergedLinear(32, [16, 16])
    norm.weight.data.uniform_(0.5, 1.5)
    lin.weight.data.normal_()
    x, res = torch.randn(3, 32), torch.randn(3, 32)
    h, new_res = norm(x, res)
    y, r = norm_linear(norm, lin, x, res)
    torch.testing.assert_close(y, lin(h)); torch.testing.assert_close(r, new_res)
    y, r = norm_linear(norm, lin, x, res, gated=True)
    torch.testing.assert_close(y, silu_and_mul_ref(lin(h)))
    y, r = norm_linear(norm, lin, x, None)  # the first layer: no add, the residual is x
    assert r is x
    torch.testing.assert_close(y, lin(norm(x)))


@pytest.mark.gpu
def test_gemv_choice_keeps_results(monkeypatch):
    """On a GPU: the per-key choice is made for every variant the layers declare, and whichever
    path a key takes, the layer call on one row matches the unfused torch layers; forcing the
    Triton GEMV for every key matches too."""
    from atom.model_ops.activation import silu_and_mul_ref
    from atom.model_ops.norm import RMSNorm
    from atom.tuning import fusions, gemv_choice
    from atom.tuning.plan import KernelPlan
    bf = torch.bfloat16
    gate_up = [MergedLinear(1024, [3072, 3072]) for _ in range(4)]
    qkv = [QKVLinear(1024, 128, 24, 4) for _ in range(4)]  # 4096 rows
    down = [Linear(3072, 1024) for _ in range(4)]
    for m in gate_up:
        m.one_row = "norm+silu"
    for m in qkv:
        m.one_row = ("norm", "norm+rope")
    layers = torch.nn.Sequential(*gate_up, *qkv, *down).cuda().to(bf)
    for m in layers:
        m.weight.data.normal_(std=0.02)
    norm = RMSNorm(1024).cuda().to(bf)
    norm.weight.data.uniform_(0.5, 1.5)
    plan = KernelPlan(backend="triton")
    for m in layers:
        m.plan = plan
    choices = gemv_choice.choose_gemv_shapes(plan, layers)
    assert set(choices) == {(6144, 1024, bf, "norm+silu"), (4096, 1024, bf, "norm"),
                            (4096, 1024, bf, "norm+rope"), (1024, 3072, bf, "plain")}
    assert all(b > 0 and t > 0 for b, t in choices.values())
    for force in (False, True):
        if force:
            plan.gemv.update({k: {} for k in choices})  # {}: the default configuration
        x, res = (torch.randn(1, 1024, device="cuda", dtype=bf) for _ in range(2))
        h, new_res = norm(x, res)
        for m, gated in ((gate_up[0], True), (qkv[0], False)):
            y, r = fusions.norm_linear(norm, m, x, res, gated=gated)
            ref = F.linear(h, m.weight)
            torch.testing.assert_close(y, silu_and_mul_ref(ref) if gated else ref, rtol=2e-2, atol=2e-2)
            assert torch.equal(r, new_res)
        x = torch.randn(1, 3072, device="cuda", dtype=bf)
        torch.testing.assert_close(down[0](x), F.linear(x, down[0].weight), rtol=2e-2, atol=2e-2)
        _check_norm_linear_rope(plan, norm, qkv[0], force)


def _check_norm_linear_rope(plan, norm, qkv, forced):
    """`norm_linear_rope` on one row: None where the choice kept the unfused path (never when
    forced), else the reference's rotated q, cached k / v and residual."""
    from atom.model_ops.kernels.gemv_rope import gemv_norm_rope_ref
    from atom.tuning.fusions import norm_linear_rope
    bf, dev = torch.bfloat16, "cuda"
    x, res = (torch.randn(1, 1024, device=dev, dtype=bf) for _ in range(2))
    pos, slot = torch.tensor([9], device=dev), torch.tensor([17], device=dev)
    cs = torch.rand(32, 128, device=dev)
    caches = [torch.zeros(2, 16, 4, 128, device=dev, dtype=bf) for _ in range(4)]
    got = norm_linear_rope(norm, qkv, x, res, pos, cs, caches[0], caches[1], slot)
    if got is None:
        assert not forced and (4096, 1024, bf, "norm+rope") not in plan.gemv
        return
    ref = gemv_norm_rope_ref(x, res, norm.weight, norm.eps, qkv.weight, 128, qkv.q_size, pos, cs,
                             caches[2], caches[3], slot)
    torch.testing.assert_close(got[0][:, :qkv.q_size], ref[0][:, :qkv.q_size], rtol=2e-2, atol=2e-2)
    assert torch.equal(got[1], ref[1])
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("norm_chosen", [False, True])
def test_rope_choice_compares_row_and_cache(monkeypatch, norm_chosen):
    """The start-up pair for "norm+rope" (here under Triton's interpreter on the CPU): the
    baseline is what the layer runs without it (the chosen "norm" GEMV or the unfused layers,
    then the rotary kernel); both return the row and the cached k / v, which agree; a wrong
    cache write is caught."""
    pytest.importorskip("triton")
    from atom.tuning import gemv_choice
    from atom.tuning.plan import KernelPlan
    if torch.cuda.is_available():
        pytest.skip("the CPU (interpreter) case")
    layer = QKVLinear(64, 16, 4, 2)  # 128 rows, head_dim 16
    layer.weight.data.normal_(std=0.1)
    cfg = dict(BLOCK_N=2, BLOCK_K=64, num_warps=4, num_stages=1, AHEAD=False)
    shapes = {(128, 64, torch.float32, "norm"): cfg} if norm_chosen else {}
    plan = KernelPlan(backend="triton", gemv=shapes)
    x = torch.randn(1, 64)
    without, fused = gemv_choice.one_row_calls(plan, "norm+rope", x, layer.weight, cfg, layer)
    got, ref = fused(), without()
    assert len(got) == 3 and got[1].abs().sum() > 0 and got[2].abs().sum() > 0  # k and v were written
    assert gemv_choice.agree(got, ref)
    assert not gemv_choice.agree((got[0], got[1] + 1, got[2]), ref)
