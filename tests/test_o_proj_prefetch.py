"""The kernel plan's opt-in "o_proj_l2_prefetch" (`atom.tuning.fusions`): o_proj's one-row
product fetches its weight rows into L2 before its PDL wait (the kernels' PF). A prefetch is a
hint, so every output must keep its bits: on the CPU the plan marks o_proj, the fp8 path routes
the prefetch to `fp8_gemv1` with the same product, and `uninstall` clears the mark; on the GPU
the two one-row kernels with PF give their bits without it, and engines with the fusion give
the same tokens. (The PTX's prefetches before the wait: `test_kernel_compile`.)"""
from __future__ import annotations

import os

import pytest
import torch

from atom.model_ops.attention.metadata import forward_context
from atom.model_ops.quant import common
from atom.tuning import fusions
from atom.tuning.fusions import default_fusions
from atom.tuning.plan import KernelPlan
from test_quant_fusions import _decoder_parts, _meta

triton = pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
FUSION = ("o_proj_l2_prefetch",)


def test_the_plan_takes_the_fusion_as_opt_in():
    assert "o_proj_l2_prefetch" not in default_fusions("triton")
    plan = KernelPlan(backend="triton", fusions=default_fusions("triton") + FUSION)
    assert plan.has("o_proj_l2_prefetch") and "o_proj_l2_prefetch" in repr(plan)
    assert fusions.O_PROJ_PREFETCH > 0 and not fusions.O_PROJ_PREFETCH & (fusions.O_PROJ_PREFETCH - 1)


def _decoder_layers(n: int = 2) -> torch.nn.ModuleList:
    """Modules shaped as `fusions.matches` reads a Llama decoder layer (the parts `install` marks)."""
    layers = torch.nn.ModuleList()
    for _ in range(n):
        layer, attn, mlp = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        for name in ("qkv_proj", "o_proj", "rotary_emb", "attn"):
            setattr(attn, name, torch.nn.Linear(4, 4))
        mlp.gate_up_proj, mlp.down_proj = torch.nn.Linear(4, 8), torch.nn.Linear(4, 4)
        layer.self_attn, layer.mlp = attn, mlp
        layer.input_layernorm, layer.post_attention_layernorm = torch.nn.Identity(), torch.nn.Identity()
        layers.append(layer)
    return layers


def test_install_marks_o_proj_and_uninstall_clears_it():
    model = _decoder_layers()
    assert all(fusions.matches(m) for m in model)
    assert fusions.install(model, KernelPlan(backend="triton", fusions=default_fusions("triton"))) == 2
    assert not any("l2_prefetch" in m.self_attn.o_proj.__dict__ for m in model)
    fusions.uninstall(model)
    assert fusions.install(model, KernelPlan(backend="triton", fusions=default_fusions("triton") + FUSION)) == 2
    assert all(m.self_attn.o_proj.l2_prefetch == fusions.O_PROJ_PREFETCH for m in model)
    assert not any("l2_prefetch" in m.self_attn.qkv_proj.__dict__ or "l2_prefetch" in m.mlp.down_proj.__dict__
                   for m in model)
    fusions.uninstall(model)
    assert not any("l2_prefetch" in m.self_attn.o_proj.__dict__ for m in model)


@pytest.mark.skipif(not INTERPRETED, reason="CPU cases need Triton's interpreter (TRITON_INTERPRET=1)")
def test_fp8_o_proj_hands_the_prefetch_to_fp8_gemv1(monkeypatch):
    """One row into a marked ptpc fp8 o_proj: its quantizer, then `fp8_gemv1` with the prefetch
    (the route stood in for on the CPU by the swap-AB kernel, which gives the same product);
    the same bits as the unmarked layer, whose launch has none. More rows, or no fusion in the
    plan: the layer as before (no prefetch)."""
    from atom.model_ops.kernels import fp8_gemv1
    from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot
    monkeypatch.setattr(common, "use_kernels", lambda t: True)
    monkeypatch.setattr(fp8_gemv1, "takes", lambda xq, xs, w, ws: xq.shape[0] == 1)
    seen = []

    def launch(xq, xs, w, ws, bias=None, out=None, out_dtype=torch.bfloat16, tile=None, prefetch=0):
        seen.append(prefetch)
        return quant_gemv_dot(xq, xs, w, ws, bias, out_dtype, 0)

    monkeypatch.setattr(fp8_gemv1, "fp8_gemv1_launch", launch)
    layer = _decoder_parts("fp8_channel")
    o = layer.self_attn.o_proj
    plan = KernelPlan(backend="triton", fusions=default_fusions("triton") + FUSION, force_kernels=True)
    plain = KernelPlan(backend="triton", fusions=default_fusions("triton"), force_kernels=True)
    o.plan = plan
    g = torch.Generator().manual_seed(3)
    a = torch.randn(1, 2048, generator=g).to(torch.bfloat16)
    with torch.no_grad(), forward_context(_meta(plan)):
        want = fusions.project(plan, o, a)
        o.l2_prefetch = 2
        got = fusions.project(plan, o, a)
        assert seen == [0, 2] and torch.equal(got, want)
        assert torch.equal(fusions.project(plain, o, a), want) and seen[-1] == 0  # the plan without it
        a3 = torch.randn(3, 2048, generator=g).to(torch.bfloat16)
        seen.clear()
        fusions.project(plan, o, a3)
        assert seen == []  # three rows: the swap-AB kernel itself, no one-row launch


def test_the_kernels_refuse_a_prefetch_that_is_not_a_power_of_two():
    from atom.model_ops.kernels import fp8_gemv1, w4_gemv1
    xq = torch.zeros(1, 1024, dtype=torch.float8_e4m3fn)  # a shape the default tile covers
    w = torch.zeros(64, 1024, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="prefetch=3"):
        fp8_gemv1.fp8_gemv1_launch(xq, torch.ones(1), w, torch.ones(64), prefetch=3)
    x = torch.zeros(1, 512, dtype=torch.bfloat16)
    words = torch.zeros(64, 64, dtype=torch.int32)
    scales = torch.ones(64, 4, dtype=torch.bfloat16)
    cfg = dict(w4_gemv1.tiles(64, "int4", 512), PF=3)
    with pytest.raises(ValueError, match="PF=3"):
        w4_gemv1.w4_gemv1_launch(x, words, scales, scales, None, torch.empty(1, 64), 0, 128, cfg, dict(HAS_ZP=False))


@pytest.mark.parametrize("pf", [1, 2, 4])
@pytest.mark.parametrize("fmt,group,zp", [("int4", 128, False), ("int4", 128, True), ("mxfp4", 32, False)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_o_proj_epilogue_gemv_with_prefetch_keeps_its_bits(fmt, group, zp, pf):
    """`w4_gemv1_add_row` at Llama-3.1-8B's o_proj (4096 x 4096) with PF: h w, the sums of h^2
    and the residual equal those without, bit for bit."""
    from atom.model_ops.kernels import w4_gemv1 as g1
    from test_h2_xpack import _row, _w4_layer
    o = _w4_layer(fmt, 4096, 4096, group, "cuda", 1, zp=zp)
    x = _row(4096, torch.bfloat16, "cuda", 3) * 1e-3
    res = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    w = (torch.rand(4096, device="cuda") + 0.5).to(torch.bfloat16)
    want = g1.w4_gemv1_add_row(x, *o, fmt, group, 4096, res, w)
    got = g1.w4_gemv1_add_row(x, *o, fmt, group, 4096, res, w, cfg=dict(g1.tiles(4096, fmt, 4096), PF=pf))
    for g_, w_ in zip(got, want):
        assert torch.equal(g_, w_), (fmt, zp, pf)


@pytest.mark.parametrize("pf", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_fp8_gemv1_with_prefetch_keeps_its_bits(n, k, pf):
    from atom.model_ops.kernels import fp8_gemv1
    g = torch.Generator(device="cuda").manual_seed(n + k)
    xq = (torch.randn(1, k, device="cuda", generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda", generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    xs, ws = torch.rand(1, device="cuda") + 0.1, torch.rand(n, device="cuda") * 1e-3
    want = fp8_gemv1.fp8_gemv1_launch(xq, xs, w, ws)
    assert torch.equal(fp8_gemv1.fp8_gemv1_launch(xq, xs, w, ws, prefetch=pf), want)


@pytest.mark.parametrize("fmt", ["fp8_dynamic", "w4a16", "mxfp4_w4a16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_engine_with_o_proj_prefetch_gives_the_same_tokens(fmt, tmp_path, monkeypatch):
    """A quantized dummy Llama (CUDA graphs) with "o_proj_l2_prefetch" added to the defaults
    decodes one prompt at a time (one-row steps: the fusion's) to the tokens of one without."""
    from test_gpu_quant_engine import GREEDY, PROMPTS, _quantized_config

    from atom import LLM
    from atom.model_engine import model_runner
    folder = _quantized_config(tmp_path, fmt)
    tokens = {}
    for extra in ((), FUSION):
        monkeypatch.setattr(model_runner, "default_fusions", lambda kernels, e=extra: default_fusions(kernels) + e)
        llm = LLM(folder, load_dummy="xavier", num_kvcache_blocks=32, enable_log_stats=False)
        assert llm.engine.runner.plan.has("o_proj_l2_prefetch") == bool(extra)
        tokens[extra] = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
        del llm
    assert tokens[FUSION] == tokens[()]
