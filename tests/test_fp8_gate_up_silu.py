"""The kernel plan's opt-in "fp8_gate_up_silu" (`atom.tuning.fusions`): at one row, ptpc fp8
gate-up's one-row product (`kernels.fp8_gemv1.fp8_gemv1_silu`, the kernel's GATED) stores
h = silu(gate) up and its partial amaxes itself, so that `silu_amax` does not run. On the CPU:
the plan takes it, the MLP routes through the method's hook with the bits of the plan without
it and one launch fewer, and falls back where it does not apply; on the GPU: the kernel's h and
quantized h equal the product + `silu_amax` + quantizer bit for bit, and engines with the
fusion give the same tokens. (Its sm90 build: `test_kernel_compile`.)"""
from __future__ import annotations

import os

import pytest
import torch

from atom.model_ops.attention.metadata import forward_context
from atom.model_ops.quant import common
from atom.tuning import fusions
from atom.tuning.fusions import default_fusions
from atom.tuning.plan import KernelPlan
from test_quant_fusions import _count, _decoder_parts, _meta

triton = pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
FUSION = ("fp8_gate_up_silu",)
I_WIDE = 1280  # wider than act_quant_fused.SPLIT_BLOCK: the SiLU quantizer splits the row


def _plans():
    base = default_fusions("triton")
    return (KernelPlan(backend="triton", fusions=base, force_kernels=True),
            KernelPlan(backend="triton", fusions=base + FUSION, force_kernels=True))


def test_the_plan_takes_the_fusion_as_opt_in():
    assert "fp8_gate_up_silu" not in default_fusions("triton")
    plan = KernelPlan(backend="triton", fusions=default_fusions("triton") + FUSION)
    assert plan.has("fp8_gate_up_silu") and "fp8_gate_up_silu" in repr(plan)


def _run_mlp(layer, plan, x, res):
    for lin in (layer.mlp.gate_up_proj, layer.mlp.down_proj):
        lin.plan = plan
    with torch.no_grad(), forward_context(_meta(plan)):
        return fusions._mlp(layer, plan, x, res)


@pytest.mark.skipif(not INTERPRETED, reason="CPU cases need Triton's interpreter (TRITON_INTERPRET=1)")
def test_the_mlp_takes_h_from_the_gate_up_hook(monkeypatch):
    """One row through an MLP of I = 1280 (the SiLU quantizer splits it): with the fusion the
    norm-quantizer, then the method's hook (stood in for on the CPU by the product and
    `silu_amax`, which the GPU test checks the kernel against), then the quantizer of the
    partials and down: the output and residual of the plan without it, and no `silu_amax`
    launch of the MLP's own. Three rows, or a plan without it: the MLP as before."""
    from atom.model_ops.kernels import act_quant_fused
    from atom.model_ops.quant.fp8 import Fp8LinearMethod
    monkeypatch.setattr(common, "use_kernels", lambda t: False)
    calls = []
    for name in ("silu_amax", "silu_quant", "norm_quant"):
        _count(monkeypatch, act_quant_fused, name, calls)
    hooked = []

    def hook(self, layer, xq, xs, out_dtype):
        hooked.append(xq.shape)
        y = layer.forward_quantized(xq, xs, out_dtype)
        return act_quant_fused.silu_amax(y, "fp8", common.FP8_MAX)

    monkeypatch.setattr(Fp8LinearMethod, "takes_one_row_silu", lambda self, layer, x: x.shape[0] == 1)
    monkeypatch.setattr(Fp8LinearMethod, "one_row_silu", hook)
    layer = _decoder_parts("fp8_channel", I=I_WIDE)
    unfused, fused = _plans()
    g = torch.Generator().manual_seed(1)
    for M in (1, 3):
        x, res = (torch.randn(M, 128, generator=g).to(torch.bfloat16) for _ in range(2))
        calls.clear()
        want = _run_mlp(layer, unfused, x, res)
        plain_calls = list(calls)
        calls.clear()
        hooked.clear()
        got = _run_mlp(layer, fused, x, res)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), M
        if M == 1:
            assert hooked == [(1, 128)] and plain_calls.count("silu_amax") == 1
            assert calls.count("norm_quant") == 1 and calls.count("silu_quant") == 0
        else:
            assert hooked == [] and calls == plain_calls


def test_the_hook_declines_where_the_kernel_does_not_run():
    """On the CPU (no one-row fp8 kernel), for a narrow MLP (its SiLU quantizer does not
    split) and an unquantized layer, `_gate_up_silu` runs nothing."""
    layer = _decoder_parts("fp8_channel", I=I_WIDE)
    _, fused = _plans()
    x, res = torch.randn(1, 128, dtype=torch.bfloat16), torch.randn(1, 128, dtype=torch.bfloat16)
    gate_up = layer.mlp.gate_up_proj
    assert not gate_up.method.takes_one_row_silu(gate_up, x)
    iq = common.InputQuant("fp8", common.FP8_MAX, True)
    assert fusions._gate_up_silu(fused, layer, x, res, iq) == (None, res)
    narrow = _decoder_parts("fp8_channel")  # I = 160
    assert fusions._gate_up_silu(fused, narrow, x, res, iq) == (None, res)


@pytest.mark.parametrize("i,k", [(14336, 4096), (1280, 256)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_fp8_gemv1_silu_gives_the_two_launches_bits(i, k):
    """h and its quantized row from the GATED kernel equal the plain product's output through
    `silu_amax` and its quantizer, bit for bit (Llama-3.1-8B's gate-up and a small shape)."""
    from atom.model_ops.kernels import fp8_gemv1
    from atom.model_ops.kernels.act_quant_fused import silu_amax
    g = torch.Generator(device="cuda").manual_seed(i + k)
    xq = (torch.randn(1, k, device="cuda", generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = (torch.randn(2 * i, k, device="cuda", generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    xs, ws = torch.rand(1, device="cuda") * 1e-2 + 1e-3, torch.rand(2 * i, device="cuda") * 1e-3 + 1e-4
    want = silu_amax(fp8_gemv1.fp8_gemv1_launch(xq, xs, w, ws), "fp8", 448.0)
    got = fp8_gemv1.fp8_gemv1_silu(xq, xs, w, ws)
    assert torch.equal(got.h, want.h)
    assert torch.equal(got.pmax.max(), want.pmax.max())
    (qg, sg), (qw, sw) = got.quantize(), want.quantize()
    assert torch.equal(qg.view(torch.uint8), qw.view(torch.uint8)) and torch.equal(sg, sw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_engine_with_fp8_gate_up_silu_gives_the_same_tokens(tmp_path, monkeypatch):
    """A ptpc fp8 dummy Llama whose MLP is 1,280 wide (its SiLU quantizer splits the row), CUDA
    graphs, one prompt at a time (one-row steps): the tokens of the engine without the fusion."""
    import json

    import transformers
    from test_gpu_quant_engine import GREEDY, PROMPTS

    from atom import LLM
    from atom.model_engine import model_runner
    from atom.benchmarks.quant_formats import get_format
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=I_WIDE, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                                   tie_word_embeddings=False, torch_dtype="bfloat16",
                                   architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["quantization_config"] = get_format("fp8_dynamic").quantization_config()
    (tmp_path / "config.json").write_text(json.dumps(data))
    tokens = {}
    for extra in ((), FUSION):
        monkeypatch.setattr(model_runner, "default_fusions", lambda kernels, e=extra: default_fusions(kernels) + e)
        llm = LLM(str(tmp_path), load_dummy="xavier", num_kvcache_blocks=32, enable_log_stats=False)
        assert llm.engine.runner.plan.has("fp8_gate_up_silu") == bool(extra)
        tokens[extra] = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
        del llm
    assert tokens[FUSION] == tokens[()]
