"""The kernel plan's "w4_down_add_norm": at one row, a 4-bit down product adds the residual in
its epilogue and writes the next layer's normed input (`NormedRow`), and the next q/k/v is the
plain one-row GEMV scaled by 1 / rms (`fusions.w4_normed_qkv`). CPU cases run the 4-bit kernels
under Triton's interpreter; the GPU engine case is in `test_h2_xpack.py`
(`test_gpu_engine_with_prepared_rows`)."""
import types

import pytest
import torch

from test_triton_kernels import CPU, GPU  # noqa: E402  (sets TRITON_INTERPRET)

from atom.model_ops.attention.metadata import forward_context  # noqa: E402
from atom.model_ops.norm import RMSNorm  # noqa: E402
from atom.tuning import fusions  # noqa: E402
from atom.tuning.fusions import default_fusions  # noqa: E402
from atom.tuning.launches import KernelLaunches  # noqa: E402
from atom.tuning.normed_row import NormedRow  # noqa: E402
from atom.tuning.plan import KernelPlan  # noqa: E402


def _two_layers(fmt, monkeypatch):
    """Two decoder layers' parts in `fmt` (`test_quant_fusions._decoder_parts`), the second with
    an input norm of its own (other weights, other eps), every product on its 4-bit kernel."""
    from test_quant_fusions import _decoder_parts

    from atom.model_ops.kernels import w4_gemm
    from atom.model_ops.quant import int4 as int4_mod
    from atom.model_ops.quant import mxfp4 as mxfp4_mod
    for mod in (w4_gemm, int4_mod, mxfp4_mod):  # every product on its kernel, as on a GPU
        monkeypatch.setattr(mod, "use_w4_kernel", lambda x: True)
    first = _decoder_parts(fmt, I=192, o_out=128)
    second = _decoder_parts(fmt, I=192, o_out=128)
    norm = RMSNorm(128, eps=1e-5)
    norm.weight.data = torch.rand(128, generator=torch.Generator().manual_seed(7)) * 2 + 0.25
    second.input_layernorm = norm
    return first, second


def _run(first, second, plan, a, res):
    """first's o_proj + MLP on the attention output `a`, then second's q/k/v, the way
    `fused_forward` chains them: (q/k/v, the residual, first's output, the launches)."""
    from test_quant_fusions import _meta
    for layer in (first, second):
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            lin.plan = plan
    with forward_context(_meta(plan)), KernelLaunches() as trace:
        qkv0 = torch.zeros(1, 256, dtype=torch.bfloat16)
        ops = fusions.w4_o_proj_add_norm_operands(first, plan, qkv0)
        out, residual = fusions.w4_o_proj_add_norm_mlp(first, plan, ops, a, res)
        if isinstance(out, NormedRow):
            qkv = fusions.w4_normed_qkv(second.self_attn, out)
        else:
            qkv, residual = fusions.norm_linear(second.input_layernorm, second.self_attn.qkv_proj, out, residual)
    return qkv, residual, out, trace.counts()


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("fmt", ["int4_g32_sym", "int4_g64_asym"])
def test_down_epilogue_then_normed_qkv_against_the_unfused_layers(device, fmt, monkeypatch):
    """With the fusion, first's down returns a `NormedRow` (h w with the second layer's norm
    weight, its eps) and the second's q/k/v comes from it: the residual the same bits as the
    unfused add, q/k/v within the rounding of h w to bf16, the same launches (no norm kernel
    either way: the unfused q/k/v has the norm inside)."""
    first, second = _two_layers(fmt, monkeypatch)
    first.__dict__["next_layer"] = second  # what `install` links
    g = torch.Generator().manual_seed(2)
    a, res = torch.randn(1, 2048, generator=g).to(torch.bfloat16), torch.randn(1, 128, generator=g).to(torch.bfloat16)
    base = default_fusions("triton")
    want_qkv, want_res, want_out, want_counts = _run(first, second, KernelPlan(backend="triton", fusions=base,
                                                                               force_kernels=True), a, res)
    plan = KernelPlan(backend="triton", fusions=base + ("w4_down_add_norm",), force_kernels=True)
    qkv, residual, out, counts = _run(first, second, plan, a, res)
    assert isinstance(want_out, torch.Tensor) and isinstance(out, NormedRow)
    assert out.eps == 1e-5 and out.shape == (1, 128) and "NormedRow(shape=(1, 128)" in repr(out)
    assert torch.equal(residual, want_res)
    # h w: the unfused add's h times the second layer's norm weight, rounded once
    torch.testing.assert_close(out.hw.float(), (want_res.float() * second.input_layernorm.weight.float()),
                               rtol=8e-3, atol=1e-6)
    err = ((qkv.float() - want_qkv.float()).abs().max() / want_qkv.float().abs().max()).item()
    assert err < 2e-2, err
    assert counts.to_dict() == want_counts.to_dict() and "_rmsnorm_kernel" not in counts
    assert counts["_w4_gemv1_kernel"] == 4


@pytest.mark.parametrize("device", [CPU])
def test_the_fusion_needs_the_link_a_4bit_qkv_and_the_plan(device, monkeypatch):
    """No `NormedRow` without the link to a next layer, without the fusion in the plan, or
    where the next q/k/v is not a 4-bit layer without a bias; a layer that cannot take one reads
    zeros and the residual (`as_input`)."""
    first, second = _two_layers("int4_g32_sym", monkeypatch)
    act = torch.randn(1, 192).to(torch.bfloat16)
    plan = KernelPlan(backend="triton", fusions=default_fusions("triton") + ("w4_down_add_norm",))
    assert fusions.w4_down_add_norm_operands(first, plan, act) is None  # not linked
    first.__dict__["next_layer"] = second
    down, norm = fusions.w4_down_add_norm_operands(first, plan, act)
    assert norm is second.input_layernorm and down[3] == "int4"
    assert fusions.w4_down_add_norm_operands(first, KernelPlan(backend="triton", fusions=default_fusions("triton")),
                                             act) is None
    second.self_attn.qkv_proj.bias = torch.nn.Parameter(torch.zeros(256))
    assert fusions.w4_down_add_norm_operands(first, plan, act) is None
    row = NormedRow(torch.ones(1, 128), torch.ones(16), 1e-6)
    res = torch.randn(1, 128)
    assert torch.equal(row.as_input(res) + res, res)
    with pytest.raises(ValueError, match="needs 'w4_o_proj_add_norm' too"):
        KernelPlan(backend="triton", fusions=("w4_down_add_norm",))


def test_install_links_each_layer_to_the_next():
    """`install` gives every matching layer with a dense MLP but the last its next layer (a plain
    reference: not a submodule), and `uninstall` takes the links away."""
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = types.SimpleNamespace(qkv_proj=types.SimpleNamespace(), o_proj=1, rotary_emb=1, attn=1)
            self.mlp = types.SimpleNamespace(gate_up_proj=types.SimpleNamespace(), down_proj=1)
            self.input_layernorm = self.post_attention_layernorm = nn.Identity()

    model = nn.Sequential(nn.ModuleList([Layer() for _ in range(3)]))
    layers = list(model[0])
    fusions.install(model, KernelPlan(backend="triton", fusions=default_fusions("triton") + ("w4_down_add_norm",)))
    assert [m.__dict__.get("next_layer") for m in layers] == [layers[1], layers[2], None]
    assert sum(1 for _ in model.modules()) == 1 + 1 + 3 * 2  # no layer registered twice
    fusions.uninstall(model)
    assert not any("next_layer" in m.__dict__ for m in layers)


@pytest.mark.slow
def test_engine_with_the_fusion_gives_the_same_tokens(tmp_path, monkeypatch):
    """A tiny W4A16 Llama in bf16 on the Triton backend, every 4-bit product on its kernel under
    the interpreter: with "w4_down_add_norm" the one-row decode steps chain each layer's down
    into the next layer's q/k/v (every layer but the last), the greedy tokens are the defaults'."""
    from conftest import make_tiny_model
    from test_quant_methods import quantize_checkpoint

    from atom import LLM, SamplingParams
    from atom.model_ops.attention.triton_backend import TritonAttentionBackend
    from atom.model_ops.kernels import w4_gemm
    from atom.model_ops.quant import int4 as int4_mod
    for mod in (w4_gemm, int4_mod):
        monkeypatch.setattr(mod, "use_w4_kernel", lambda x: True)
    base = make_tiny_model(tmp_path / "base", "llama", hidden_size=128, intermediate_size=256, initializer_range=0.4)
    path = str(tmp_path / "w4a16")
    quantize_checkpoint(str(base), path, "w4a16_g32")
    calls = []
    real = fusions.w4_normed_qkv
    monkeypatch.setattr(fusions, "w4_normed_qkv", lambda *a: calls.append(1) or real(*a))
    llm = LLM(path, dtype="bfloat16", enable_log_stats=False, num_kvcache_blocks=32, enforce_eager=True)
    runner = llm.engine.runner
    runner.set_attention_backend(TritonAttentionBackend(runner.attn_layers, 64, runner.device))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = {}
    for extra in ((), ("w4_down_add_norm",)):
        runner.install_plan(KernelPlan(backend="triton", fusions=default_fusions("triton") + extra, force_kernels=True))
        calls.clear()
        out[extra] = llm.generate([[5, 6, 7, 8, 9]], greedy, use_tqdm=False)[0].token_ids
        layers = len(runner.model.model.layers)
        assert len(calls) == (3 * (layers - 1) if extra else 0)  # 3 one-row decode steps
    assert out[()] == out[("w4_down_add_norm",)]


@pytest.mark.parametrize("device", [GPU])
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int4", 64), ("mxfp4", 32), ("mxfp4_pairs", 32)])
def test_gpu_down_epilogue_then_qkv(device, fmt, group):
    """Down adding the residual in its epilogue and writing the next layer's input, q/k/v applying
    1 / rms (Llama-3.1-8B's shapes: down 4096 x 14336 on its table tile, q/k/v 6144 x 4096 on the
    tile of the GEMV with the norm inside, as `fusions.w4_normed_qkv` runs it),
    against down, then q/k/v with the add + RMSNorm inside (`w4_gemv1_fused`, the default it
    replaces): the same residual bit for bit, q/k/v within the normalised row's bf16 rounding."""
    from test_h2_xpack import _product_pair

    from atom.model_ops.kernels import w4_gemv1 as g1
    from atom.model_ops.kernels.w4_gemm import w4_linear_launch
    down, qkv, act, res, w = _product_pair(fmt, group, device, (4096, 14336), (6144, 4096))
    y = w4_linear_launch(act, *down, None, fmt, group, 14336)
    want, res_ref = g1.w4_gemv1_fused(y, res, w, 1e-5, *qkv, fmt, group, 4096)
    hw, sums, rout = g1.w4_gemv1_add_row(act, *down, fmt, group, 14336, res, w)
    assert torch.equal(rout, res_ref)
    assert torch.equal(hw, (rout.float() * w.float()).to(torch.bfloat16))
    got = g1.w4_gemv1_rsq(hw, sums, 1e-5, *qkv, fmt, group, 4096)  # w4_normed_qkv's: the table's tile
    assert got.shape == (1, 6144)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < 1e-2, err
