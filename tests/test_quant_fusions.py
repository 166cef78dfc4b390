"""The kernel plan's fusions for 8-bit layers ("norm+quant", "silu+quant", "split_k_fold";
`atom.tuning.fusions`) on the CPU, under Triton's interpreter: the plan keeps and shows them;
the fused pieces of a decoder layer (norm + q/k/v, norm + gate-up + SiLU + down, o_proj) give
the unfused layers' bits (ptpc fp8, int8 W8A8, per-tensor fp8), with the products on their
torch reference and on the GPU routes (forced); and a tiny Llama quantized ptpc fp8
generates the same greedy tokens with the fusions installed as without."""
from __future__ import annotations

import os
import types

import pytest
import torch

from atom.model_ops.attention.metadata import AttentionMetadata, forward_context
from atom.model_ops.linear import Linear, MergedLinear, QKVLinear, RowParallelLinear
from atom.model_ops.norm import RMSNorm
from atom.model_ops.quant import common
from atom.tuning import fusions
from atom.tuning.fusions import default_fusions
from atom.tuning.plan import KernelPlan
from conftest import make_tiny_model
from test_quant_kernels_fp8 import INT8_SPEC
from test_quant_methods import FORMATS, OneSpec, fill, q_int4, q_int8_channel

triton = pytest.importorskip("triton")
NEW = ("norm+quant", "silu+quant", "split_k_fold", "sum+norm+quant", "quant_on_load", "qkv_sum_in_attention")
OPT_IN = ("split_k_fold", "sum+norm+quant", "quant_on_load", "qkv_sum_in_attention")
# CPU tensors through the kernels need the interpreter (set by conftest where there is no GPU)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _plans():
    """(unfused, fused): the Triton plan without and with the 8-bit fusions (the opt-in fold
    included), kernels forced onto CPU tensors (the interpreter)."""
    every = default_fusions("triton") + OPT_IN
    return (KernelPlan(backend="triton", fusions=[f for f in every if f not in NEW], force_kernels=True),
            KernelPlan(backend="triton", fusions=every, force_kernels=True))


def _plan_pair(*extra):
    """(the default Triton fusions, the same with `extra`), kernels forced onto CPU tensors."""
    base = default_fusions("triton")
    return (KernelPlan(backend="triton", fusions=base, force_kernels=True),
            KernelPlan(backend="triton", fusions=base + extra, force_kernels=True))


def _count(monkeypatch, module, name, calls):
    """Record a call of `module.name` in `calls` (then run it)."""
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(name) or real(*a, **k))


def test_the_plan_has_shows_and_keeps_the_fusions(tmp_path):
    assert {"norm+quant", "silu+quant"} <= set(default_fusions("triton"))
    assert not set(OPT_IN) & set(default_fusions("triton"))  # opt-in (tuning/fusions.py says why)
    for w4 in ("w4_norm_gemv", "w4_o_proj_add_norm", "w4_gate_up_silu", "fp4_pair_words"):  # the 4-bit kernels' fusions: Triton only
        assert w4 in default_fusions("triton") and w4 not in default_fusions("aiter")
    assert not set(NEW) & set(default_fusions("aiter")) and default_fusions("torch") == ()
    plan = KernelPlan(backend="triton", fusions=NEW)
    assert all(plan.has(f) for f in NEW) and all(f in repr(plan) for f in NEW)
    loaded = KernelPlan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.fusions == NEW and loaded.to_dict() == plan.to_dict()
    with pytest.raises(ValueError, match=r"fusions=\['norm\+quantize'\] are invalid"):
        KernelPlan(fusions=("norm+quantize",))


# ---------------------------------------------------------------------------
# the fused pieces of a decoder layer against the unfused layers
# ---------------------------------------------------------------------------

def _spec(fmt):
    return INT8_SPEC if fmt == "int8" else FORMATS[fmt]["spec"]


def _quant(fmt, w):
    if fmt == "int8":
        return q_int8_channel(w)
    return q_int4(w, *FORMATS[fmt]["int4"])[0] if "int4" in FORMATS[fmt] else FORMATS[fmt]["quant"](w)


def _loaded(layer, fmt, seed):
    g = torch.Generator().manual_seed(seed)
    for sid in layer.shard_ids():
        w = torch.randn(layer.shard_range(sid)[1], layer.in_features, generator=g) * 0.1
        for name, t in _quant(fmt, w).items():
            fill(layer, name, t, sid)
    layer.method.process_weights_after_loading(layer)
    return layer


def _decoder_parts(fmt, H=128, I=160, K_o=2048, device="cpu", o_out=64):
    """The projections and norms of a decoder layer in `fmt` on `device` (o_proj 2048 wide:
    its K splits in two, so that the folded split K runs), as `fusions` reads them."""
    qc = OneSpec(_spec(fmt))
    attn = types.SimpleNamespace(
        qkv_proj=_loaded(QKVLinear(H, 32, 4, 2, quant_config=qc, prefix="l.qkv_proj"), fmt, 1),
        o_proj=_loaded(RowParallelLinear(K_o, o_out, quant_config=qc, prefix="l.o_proj"), fmt, 2))
    mlp = types.SimpleNamespace(
        gate_up_proj=_loaded(MergedLinear(H, [I, I], quant_config=qc, prefix="l.gate_up_proj"), fmt, 3),
        down_proj=_loaded(RowParallelLinear(I, H, quant_config=qc, prefix="l.down_proj"), fmt, 4))
    norm = RMSNorm(H)
    norm.weight.data = torch.rand(H, generator=torch.Generator().manual_seed(5)) + 0.5
    for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, norm):
        m.to(device)
    layer = types.SimpleNamespace(self_attn=attn, mlp=mlp, input_layernorm=norm, post_attention_layernorm=norm)
    fusions._give_locks(layer)
    return layer


def _meta(plan):
    """A forward's context holding `plan` (the layers' norms and SiLU then take its kernels)."""
    z = torch.zeros(1, dtype=torch.int32)
    return AttentionMetadata(z, z, z.reshape(1, 1), z.long(), 1, 1, plan=plan)


def _run_parts(layer, plan, x, res, a):
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        lin.plan = plan
    with forward_context(_meta(plan)):
        qkv, r1 = fusions.norm_linear(layer.input_layernorm, layer.self_attn.qkv_proj, x, res)
        first = fusions.norm_linear(layer.input_layernorm, layer.self_attn.qkv_proj, x, None)
        o = fusions.project(plan, layer.self_attn.o_proj, a)
        out, r2 = fusions._mlp(layer, plan, x, res)
    return qkv, r1, first[0], o, out, r2


@pytest.mark.skipif(not INTERPRETED, reason="CPU cases need Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("gpu_routes", [False, True])
@pytest.mark.parametrize("fmt", ["fp8_channel", "int8", "fp8_tensor_dynamic"])
def test_fused_pieces_give_the_unfused_layers_bits(fmt, gpu_routes, monkeypatch):
    """norm + q/k/v, o_proj and norm + gate-up + SiLU + down at M = 1, 3, 17: the fused path
    (the quantizer in the norm / SiLU kernel, the product on q; o_proj's split K folded) and
    the unfused layers give the same bits, the products on their torch reference
    (`gpu_routes` False, the CPU's) or on the GPU routes (forced: the swap-AB kernel and its
    fold, under the interpreter). Dynamic per-tensor fp8 is fused for one row only."""
    monkeypatch.setattr(common, "use_kernels", lambda t: gpu_routes)
    _check_fused_pieces(fmt, "cpu", gpu_routes, monkeypatch)


def _swap_ab_at_one_row(monkeypatch):
    """The GPU cases compare against the swap-AB kernel, whose split K these fusions fold,
    defer or feed: one row of fp8 otherwise runs `fp8_gemv1`, which splits nothing (the
    opt-in fusions put their products back on the swap-AB kernel)."""
    monkeypatch.setattr(common, "ONE_ROW_FP8", False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["fp8_channel", "int8", "fp8_tensor_dynamic"])
def test_fused_pieces_on_gpu_give_the_unfused_layers_bits(fmt, monkeypatch):
    """The same on CUDA tensors, compiled kernels and the GPU routes (the fold included)."""
    _swap_ab_at_one_row(monkeypatch)
    _check_fused_pieces(fmt, "cuda", True, monkeypatch)


def _check_fused_pieces(fmt, device, gpu_routes, monkeypatch):
    layer = _decoder_parts(fmt, device=device)
    assert layer.self_attn.o_proj.split_k_lock.dtype == torch.int32
    calls = []
    from atom.model_ops.kernels import act_quant_fused, split_k
    for mod, name in ((act_quant_fused, "norm_quant"), (act_quant_fused, "silu_quant"), (split_k, "split_k_sum")):
        _count(monkeypatch, mod, name, calls)
    from atom.model_ops.kernels import quant_gemv_dot
    monkeypatch.setattr(quant_gemv_dot, "split_k_sum", split_k.split_k_sum)  # (imported by name there)
    unfused, fused = _plans()
    g = torch.Generator().manual_seed(0)
    kind = "int8" if fmt == "int8" else "fp8"
    for M in (1, 3, 17) + ((300,) if device == "cuda" else ()):  # 300: past the swap-AB rows (cuBLASLt's)
        x, res = (torch.randn(M, 128, generator=g).to(torch.bfloat16).to(device) for _ in range(2))
        a = torch.randn(M, 2048, generator=g).to(torch.bfloat16).to(device)
        calls.clear()
        want = _run_parts(layer, unfused, x, res, a)
        assert "norm_quant" not in calls and "silu_quant" not in calls
        splits_unfused = calls.count("split_k_sum")
        calls.clear()
        got = _run_parts(layer, fused, x, res, a)
        for g_, w_ in zip(got, want):
            assert g_.dtype == w_.dtype and torch.equal(g_, w_), (fmt, M)
        fused_here = (fmt != "fp8_tensor_dynamic" or M == 1) and M <= fusions.FUSED_QUANT_MAX_ROWS.get(kind, M)
        assert (calls.count("norm_quant"), calls.count("silu_quant")) == ((3, 1) if fused_here else (0, 0))
        if gpu_routes and fused_here and M <= 64:  # o_proj: 2048 / 256 = 8 K steps, split in two; folded when fused
            assert splits_unfused >= 1 and calls.count("split_k_sum") == splits_unfused - 1
    assert not layer.self_attn.o_proj.split_k_lock.any()


@pytest.mark.skipif(not INTERPRETED, reason="CPU cases need Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("fmt", ["fp8_channel", "int8"])
def test_o_proj_partials_summed_by_the_norm_quantizer(fmt, monkeypatch):
    """"sum+norm+quant": o_proj's swap-AB product (K 2048 split in two, GPU routes forced)
    comes back as a `PendingSum` and the MLP's norm-quantizer adds its partials: the bits of
    the plan without it (the reduction kernel, then the norm-quantizer), one reduction launch
    fewer; a norm that does not quantize (an unquantized gate-up) settles the sum first."""
    monkeypatch.setattr(common, "use_kernels", lambda t: True)
    _check_pending_o_proj(fmt, "cpu", monkeypatch)
    _check_pending_down(fmt, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["fp8_channel", "int8"])
def test_o_proj_partials_summed_by_the_norm_quantizer_on_gpu(fmt, monkeypatch):
    """The same on CUDA tensors and compiled kernels."""
    _swap_ab_at_one_row(monkeypatch)
    _check_pending_o_proj(fmt, "cuda", monkeypatch)
    _check_pending_down(fmt, "cuda")


@pytest.mark.skipif(not INTERPRETED, reason="CPU cases need Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("fmt", ["fp8_channel", "int8"])
def test_down_quantizes_silu_rows_on_load(fmt, monkeypatch):
    """"quant_on_load": where SiLU-and-mul's quantizer splits rows (I 2048 > 1024), down's
    swap-AB product (GPU routes forced) reads the rows and their partial amaxes and
    quantizes them itself: the bits of the plan without it, without the quantizer's second
    launch, at one row; more rows (3; 80, where fp8's down takes another route) keep it."""
    monkeypatch.setattr(common, "use_kernels", lambda t: True)
    _check_quant_on_load(fmt, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["fp8_channel", "int8"])
def test_down_quantizes_silu_rows_on_load_on_gpu(fmt, monkeypatch):
    """The same on CUDA tensors and compiled kernels."""
    _swap_ab_at_one_row(monkeypatch)
    _check_quant_on_load(fmt, "cuda", monkeypatch)


def _check_quant_on_load(fmt, device, monkeypatch, defer=True):
    """`defer`: also with "sum+norm+quant" (down's swap-AB product leaving its split K)."""
    from atom.model_ops.kernels import act_quant_fused, split_k
    calls = []
    _count(monkeypatch, act_quant_fused, "quant_from_partials", calls)
    layer = _decoder_parts(fmt, I=2048, device=device)
    unfused, fused = _plan_pair("quant_on_load")
    g = torch.Generator().manual_seed(11)
    for M in (1, 3) + ((80,) if fmt == "fp8_channel" else ()):
        x, res = (torch.randn(M, 128, generator=g).to(torch.bfloat16).to(device) for _ in range(2))
        got = {}
        for name, plan in (("unfused", unfused), ("fused", fused)):
            for lin in (layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.plan = plan
            calls.clear()
            with forward_context(_meta(plan)):
                got[name] = fusions._mlp(layer, plan, x, res), len(calls)
        (out_u, r_u), n_u = got["unfused"]
        (out_f, r_f), n_f = got["fused"]
        assert torch.equal(out_f, out_u) and torch.equal(r_f, r_u), M
        assert n_u == 1 and n_f == (0 if M <= fusions.QUANT_ON_LOAD_MAX_ROWS else 1), (M, n_u, n_f)
        if not defer:
            continue
        # with "sum+norm+quant", down's product on load also leaves its split K to the next norm
        both = _plan_pair("quant_on_load", "sum+norm+quant")[1]
        for lin in (layer.mlp.gate_up_proj, layer.mlp.down_proj):
            lin.plan = both
        layer.defer_output = True
        calls.clear()
        with forward_context(_meta(both)):
            out_b, r_b = fusions._mlp(layer, both, x, res)
        del layer.defer_output
        summed = out_b.result() if isinstance(out_b, split_k.PendingSum) else out_b
        assert torch.equal(summed, out_u) and torch.equal(r_b, r_u) and len(calls) == n_f


def _check_pending_down(fmt, device):
    """down's product (K 2048 split in two) of a layer marked `defer_output` comes back
    unsummed and the next layer's norm-quantizer in front of q/k/v adds it: the unfused
    plan's bits; `fused_forward`'s settling rule sums it where the next q/k/v is not 8-bit."""
    from atom.model_ops.kernels import split_k
    layer = _decoder_parts(fmt, I=2048, device=device)
    layer.defer_output = True
    unfused, fused = _plan_pair("sum+norm+quant")
    g = torch.Generator().manual_seed(9)
    for M in (1, 3):
        x, res = (torch.randn(M, 128, generator=g).to(torch.bfloat16).to(device) for _ in range(2))
        got = {}
        for name, plan in (("unfused", unfused), ("fused", fused)):
            for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.plan = plan
            with forward_context(_meta(plan)):
                out, r = fusions._mlp(layer, plan, x, res)
                assert isinstance(out, split_k.PendingSum) == (name == "fused")
                got[name] = fusions.norm_linear(layer.input_layernorm, layer.self_attn.qkv_proj, out, r)
        for g_, w_ in zip(got["fused"], got["unfused"]):
            assert torch.equal(g_, w_)


def _check_pending_o_proj(fmt, device, monkeypatch):
    from atom.model_ops.kernels import quant_gemv_dot, split_k
    calls = []
    _count(monkeypatch, quant_gemv_dot, "split_k_sum", calls)
    layer = _decoder_parts(fmt, o_out=128, device=device)
    unfused, fused = _plan_pair("sum+norm+quant")
    g = torch.Generator().manual_seed(7)
    for M in (1, 3):
        res = torch.randn(M, 128, generator=g).to(torch.bfloat16).to(device)
        a = torch.randn(M, 2048, generator=g).to(torch.bfloat16).to(device)
        got = {}
        for name, plan in (("unfused", unfused), ("fused", fused)):
            for lin in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.plan = plan
            calls.clear()
            with forward_context(_meta(plan)):
                h = fusions.project_pending(plan, layer.self_attn.o_proj, a)
                assert isinstance(h, split_k.PendingSum) == (name == "fused")
                got[name] = fusions._mlp(layer, plan, h, res), len(calls)
        (out_u, r_u), n_u = got["unfused"]
        (out_f, r_f), n_f = got["fused"]
        assert torch.equal(out_f, out_u) and torch.equal(r_f, r_u) and n_f == n_u - 1 >= 0
    # a norm that does not quantize (an unquantized gate-up) takes the summed product
    pending = fusions.project_pending(fused, layer.self_attn.o_proj, a)
    plain = types.SimpleNamespace(self_attn=layer.self_attn, post_attention_layernorm=layer.post_attention_layernorm,
                                  mlp=types.SimpleNamespace(gate_up_proj=Linear(128, 320).to(torch.bfloat16).to(device),
                                                           down_proj=Linear(160, 128).to(torch.bfloat16).to(device)))
    for lin in (plain.mlp.gate_up_proj, plain.mlp.down_proj):
        lin.weight.data = (torch.randn(lin.weight.shape, generator=g) * 0.05).to(lin.weight)
        lin.plan = fused
    with forward_context(_meta(fused)):
        out, r = fusions._mlp(plain, fused, pending, res)
        want, rw = fusions._mlp(plain, fused, pending.result(), res)
    assert torch.equal(out, want) and torch.equal(r, rw)


def test_fused_pieces_fall_back_where_they_do_not_apply(monkeypatch):
    """Unquantized layers, weight-only or static 8-bit layers, plans without the fusions and
    a torch-backend plan, more rows than the fusions take: `quant_input` says no and the
    pieces run the layers as before."""
    layer = _decoder_parts("fp8_channel")
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    unfused, fused = _plans()
    qkv = layer.self_attn.qkv_proj
    assert fusions.quant_input(fused, "norm+quant", qkv, x) == common.InputQuant("fp8", 448.0, True)
    assert fusions.quant_input(unfused, "norm+quant", qkv, x) is None
    assert "fp8" not in fusions.FUSED_QUANT_MAX_ROWS  # fp8: every row count, a prefill's included
    assert fusions.quant_input(fused, "norm+quant", qkv, torch.randn(4096, 128, dtype=torch.bfloat16)) is not None
    i8 = _decoder_parts("int8").self_attn.qkv_proj  # int8: fewer rows (the GPU test's bits)
    i8_rows = fusions.FUSED_QUANT_MAX_ROWS["int8"]
    assert fusions.quant_input(fused, "norm+quant", i8, torch.randn(i8_rows, 128, dtype=torch.bfloat16)) is not None
    assert fusions.quant_input(fused, "norm+quant", i8, torch.randn(i8_rows + 1, 128, dtype=torch.bfloat16)) is None
    assert fusions.quant_input(None, "norm+quant", qkv, x) is None
    assert fusions.quant_input(KernelPlan(backend="triton", fusions=NEW), "norm+quant", qkv, x) is None  # CPU
    assert fusions.quant_input(fused, "norm+quant", Linear(128, 64), x) is None
    static = _loaded(Linear(128, 64, quant_config=OneSpec(FORMATS["fp8_tensor_static"]["spec"]), prefix="s"),
                     "fp8_tensor_static", 1)
    assert fusions.quant_input(fused, "norm+quant", static, x) is None
    with pytest.raises(NotImplementedError, match="takes no pre-quantized input"):
        Linear(128, 64).forward_quantized(x, x, torch.bfloat16)


# ---------------------------------------------------------------------------
# the engine: a tiny quantized Llama, greedy tokens with and without the fusions
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base128(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama128"), "llama", hidden_size=128,
                           intermediate_size=256, initializer_range=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["fp8_dynamic"])
def test_quantized_llama_generates_the_same_tokens_fused(base128, tmp_path, scheme, monkeypatch):
    """The engine on the Triton backend (attention, norms, SiLU and the 8-bit GPU routes
    under the interpreter): the decoder layers' fused forward with the 8-bit fusions gives
    the unfused forward's greedy tokens (a prefill of two requests, a two-row decode step,
    one-row steps), and the fused kernels ran (o_proj quantizing the attention's output on
    load among them: "quant_on_load"); with every small product's K split, the attention
    summing q/k/v's partials ("qkv_sum_in_attention") gives them too. (int8 W8A8 goes through the same pieces:
    `test_fused_pieces_give_the_unfused_layers_bits`.)"""
    from atom import LLM, SamplingParams
    from atom.model_ops.attention.triton_backend import TritonAttentionBackend
    from atom.model_ops.kernels import act_quant_fused
    from test_quant_methods import quantize_checkpoint
    path = str(tmp_path / scheme)
    quantize_checkpoint(base128, path, scheme)
    monkeypatch.setattr(common, "use_kernels", lambda t: True)
    from atom.model_ops.kernels import quant_gemv_dot
    calls = []
    for mod, name in ((act_quant_fused, "norm_quant"), (act_quant_fused, "silu_quant"),
                      (quant_gemv_dot, "quant_gemv_dot_pending_launch")):
        _count(monkeypatch, mod, name, calls)
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32, enforce_eager=True)
    runner = llm.engine.runner
    runner.set_attention_backend(TritonAttentionBackend(runner.attn_layers, 64, runner.device))
    # one prefill of both, a two-row decode step, then one-row steps for the longer request
    prompts = [[5, 6, 7, 8, 9], list(range(10, 22))]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 4)]
    out = {}
    unfused, fused = _plans()
    # also without the fold: o_proj quantizing on load leaves its split K to the MLP's norm
    summed = KernelPlan(backend="triton", fusions=[f for f in fused.fusions if f != "split_k_fold"],
                        force_kernels=True)
    for name, plan in (("unfused", unfused), ("fused", fused), ("summed", summed)):
        runner.install_plan(plan)
        calls.clear()
        out[name] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert ("norm_quant" in calls and "silu_quant" in calls) == (name != "unfused")
        # "quant_on_load": o_proj quantized the attention's output on load in the one-row steps
        assert ("quant_gemv_dot_pending_launch" in calls) == (name != "unfused")
    assert out["fused"] == out["unfused"] == out["summed"]
    # every small product's K split in two (the tiny layers' K does not split by the table):
    # q/k/v's partials summed by the attention kernel in the one-row steps, the same tokens
    from atom.model_ops.attention import triton_backend
    table = quant_gemv_dot.small_m_config

    def split_table(M, N, K, block_k=0, kind="fp8", act="token", big_smem=True):
        cfg = table(M, N, K, block_k, kind, act, big_smem)
        return dict(cfg, BLOCK_K=32, SPLIT_K=2) if cfg is not None and not block_k else cfg

    monkeypatch.setattr(quant_gemv_dot, "small_m_config", split_table)
    attend = triton_backend.unified_attention
    monkeypatch.setattr(triton_backend, "unified_attention",
                        lambda *a, **k: calls.append("qkv_sum" if k.get("qkv_sum") else "attn") or attend(*a, **k))
    for name, plan in (("unfused split", unfused), ("summed split", summed)):
        runner.install_plan(plan)
        calls.clear()
        out[name] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert ("qkv_sum" in calls) == (name == "summed split")
    assert out["summed split"] == out["unfused split"] == out["unfused"]
    # the launches they save, counted (KernelLaunches): a 12-token prefill and two one-row decode
    # steps through 2 layers of 4 products, each product's K split
    from atom.tuning.launches import KernelLaunches
    counts = {}
    for name, plan in (("defaults", _plan_pair()[0]),
                       ("opt-ins", _plan_pair("sum+norm+quant", "quant_on_load", "qkv_sum_in_attention")[1])):
        runner.install_plan(plan)
        with KernelLaunches() as trace:
            llm.generate([list(range(10, 22))], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                         use_tqdm=False)
        counts[name] = trace.counts()
    steps, layers = 3, len(runner.model.model.layers)
    d, o = counts["defaults"], counts["opt-ins"]
    assert d["_qdot_kernel"] == o["_qdot_kernel"] == 4 * layers * steps
    assert d["_split_k_sum_kernel"] == 4 * layers * steps
    # left: gate-up's sums (no fusion takes them), the last layer's down (nothing after it to
    # sum it), and q/k/v's in the prefill (the attention sums them in decode steps only)
    assert o["_split_k_sum_kernel"] == layers * steps + steps + layers
    # o_proj's quantizer: gone from the one-row steps ("quant_on_load")
    assert d["_act_quant_kernel"] == layers * steps and o["_act_quant_kernel"] == layers
    assert "KernelLaunches(" in repr(trace) and list(trace.frame().columns) == ["kernel", "grid"]
    monkeypatch.setattr(quant_gemv_dot, "small_m_config", table)
    runner.install_plan(fused)
    layers = runner.model.model.layers
    layer = layers[0]
    assert "forward" in layer.__dict__ and layer.self_attn.o_proj.split_k_lock.dtype == torch.int32
    # every layer but the last may leave its output's split-K sum to the next one's norm
    assert all(m.__dict__.get("defer_output") for m in layers[:-1]) and "defer_output" not in layers[-1].__dict__
    fusions.uninstall(runner.model)
    assert not any("defer_output" in m.__dict__ for m in layers)


@pytest.mark.skipif(not INTERPRETED, reason="CPU cases need Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("fmt", ["int4_g32_sym", "int4_g64_asym"])
def test_4bit_fused_pieces_match_the_unfused_layers(fmt, monkeypatch):
    """"w4_norm_gemv" with the 4-bit kernels forced onto CPU tensors (the interpreter): at one
    row, norm + q/k/v runs `w4_gemv1_fused` (calls counted; gate-up and down keep their
    kernels), within bf16 rounding of the unfused layers (the fused kernel does not round the
    normed row); at three rows nothing is fused."""
    from atom.model_ops.kernels import w4_gemm, w4_gemv1
    monkeypatch.setattr(w4_gemm, "use_w4_kernel", lambda x: True)
    calls = []
    real = w4_gemv1.w4_gemv1_fused
    monkeypatch.setattr(w4_gemv1, "w4_gemv1_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = _decoder_parts(fmt, I=192)  # (64-wide groups divide down's K)
    base = tuple(f for f in default_fusions("triton") if f != "w4_norm_gemv")
    unfused = KernelPlan(backend="triton", fusions=base, force_kernels=True)
    fused = KernelPlan(backend="triton", fusions=base + ("w4_norm_gemv",), force_kernels=True)
    g = torch.Generator().manual_seed(1)
    for M in (1, 3):
        x, res = (torch.randn(M, 128, generator=g).to(torch.bfloat16) for _ in range(2))
        a = torch.randn(M, 2048, generator=g).to(torch.bfloat16)
        want = _run_parts(layer, unfused, x, res, a)
        assert not calls
        got = _run_parts(layer, fused, x, res, a)
        assert len(calls) == (2 if M == 1 else 0)  # q/k/v with and without the residual
        calls.clear()
        for g_, w_ in zip(got, want):
            assert g_.shape == w_.shape and g_.dtype == w_.dtype
            err = ((g_.float() - w_.float()).abs().max() / w_.float().abs().max()).item()
            assert err < (2e-2 if M == 1 else 1e-6), (fmt, M, err)
