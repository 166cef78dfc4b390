"""The one-row ptpc FP8 product quantizing its row on load (`fp8_gemv1_pending_launch`, QX): on
the CPU, the torch model of its arithmetic (`qx_ref`: Markstein's correction of x / xs, e4m3's
rounding) against `act_quant`'s reference bit for bit, the generated PTX evaluated instruction
by instruction against that model, which rows it takes, and the route handing a pending row to
it; on a GPU (marked gpu) the kernel against the quantizer then `fp8_gemv1_launch`, bit for bit,
and the MLP's down quantizing SiLU-and-mul's rows on load through it."""
from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from atom.model_ops.kernels import fp8_gemv1
from atom.model_ops.kernels.act_quant import act_quant_ref
from atom.model_ops.kernels.pending_quant import PendingQuant
from atom.model_ops.quant import common
from atom.tuning.plan import KernelPlan
from test_fp4_pair_words import ptx_instructions

E4M3 = torch.float8_e4m3fn
NVIDIA = torch.cuda.is_available() and torch.version.hip is None \
    and torch.cuda.get_device_capability() >= fp8_gemv1.MIN_CAPABILITY
GPU_ONLY = pytest.mark.skipif(not NVIDIA, reason="needs an NVIDIA sm_89+ GPU (cvt.rn.satfinite.e4m3x2.f32)")
# e4m3 midpoints (ties to even): between 1 and 1.125, 1.125 and 1.25, 3 and 3.25, the subnormals
# 2^-9 and 2^-8, 416 and 448, 0 and 2^-9
TIES = (1.0625, 1.1875, 3.125, 1.5 * 2.0 ** -9, 432.0, 2.0 ** -10)


# amax 69 (xs = 69 / 448 inexact): x / xs = 0.65625 exactly, a tie of 0.625 and 0.6875, where
# x (1 / xs) alone rounds the other way: Markstein's correction decides the e4m3 value
CORRECTED = (69.0, 0.10107421875)


def row(dtype, k=4096, seed=0, ties=False):
    """A row of k activations with outliers and each chunk's amax (16 chunks: the partials a
    kernel in front stores). `ties`: amax 56 (xs = 1 / 8 exactly) and values x / xs on e4m3's
    midpoints, both signs; "corrected": `CORRECTED`'s amax and value, both signs."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, k, generator=g) * torch.exp(torch.randn(1, k, generator=g) * 2)
    if ties == "corrected":
        h = h / h.abs().max() * 60
        h[0, 0], h[0, 1], h[0, 2] = CORRECTED[0], CORRECTED[1], -CORRECTED[1]
    elif ties:
        h = h / h.abs().max() * 50
        h[0, 0] = 56.0
        mids = torch.tensor(TIES) / 8
        h[0, 1:1 + 2 * len(TIES)] = torch.cat([mids, -mids])
    h = h.to(dtype)
    return h, h.float().abs().reshape(1, 16, -1).amax(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["random", "ties", "corrected", "every value", "tiny row"])
def test_model_gives_the_quantizers_bits(dtype, case):
    """`qx_ref` (x r, its remainder, one correction; e4m3's rounding) gives `act_quant_ref`'s
    (x / xs correctly rounded) e4m3 values and scale: random rows, e4m3's ties (with an exact
    and an inexact 1 / xs), every finite 16-bit value below the amax, and a row below the
    1e-12 floor."""
    if case == "every value":
        h = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        h = h[torch.isfinite(h) & (h.float().abs() <= 1000.0)][None, :]
        h = h[:, :h.shape[1] // 16 * 16]
        pm = h.float().abs().reshape(1, 16, -1).amax(-1)
    elif case == "tiny row":
        h, _ = row(dtype, seed=3)
        h = (h.float() * 1e-15).to(dtype)
        pm = h.float().abs().reshape(1, 16, -1).amax(-1)
    else:
        h, pm = row(dtype, seed=1, ties=case if case in ("ties", "corrected") else False)
    q, xs = fp8_gemv1.qx_ref(h, pm)
    want_q, want_s = act_quant_ref(h, "fp8", h.shape[1], 448.0)
    assert torch.equal(xs, want_s.reshape(1))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) or \
        torch.equal(q.float(), want_q.float())  # (a -0 may stand for +0: the same product)
    if case == "ties":
        got = q.float()[0, 1:1 + 2 * len(TIES)].abs()
        assert got[:len(TIES)].tolist() == [1.0, 1.25, 3.0, 2.0 ** -8, 448.0, 0.0]
    if case == "corrected":
        assert q.float()[0, 1:3].tolist() == [0.625, -0.625]
        r = torch.ones(1) / xs  # the product alone would round the tie up
        assert (h.float()[0, 1] * r).clamp(-448, 448).to(E4M3).float().item() == 0.6875


# --- the generated PTX, evaluated ---------------------------------------------------------

def _f32(bits: int) -> float:
    return float(np.array([bits & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0])


def _bits32(v) -> int:
    return int(np.array([v], dtype=np.float32).view(np.uint32)[0])


def _f16(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def _bits16(v: float) -> int:
    return int(np.array([v], dtype=np.float16).view(np.uint16)[0])


def _rn32(exact: Fraction) -> int:
    """The float32 nearest to an exact value (ties to even), as bits."""
    c = np.float32(float(exact))
    cands = [c, np.nextafter(c, np.float32(np.inf)), np.nextafter(c, np.float32(-np.inf))]
    return _bits32(min(cands, key=lambda t: (abs(Fraction(float(t)) - exact), _bits32(t) & 1)))


def _e4m3(v: float) -> int:
    return int(torch.tensor([v]).clamp(-448.0, 448.0).to(E4M3).view(torch.uint8).item())


def _e4m3_f16(byte: int) -> int:
    return _bits16(torch.tensor([byte], dtype=torch.uint8).view(E4M3).float().item())


def run_qx(ptx: str, word: int, inv: float, nxs: float) -> tuple[int, int]:
    """Evaluates `qx_ptx`'s body: $2 an int64 of four 16-bit values, $3 / $4 float32; every
    float32 operation rounds its exact result once (fma included), fp16 ones likewise."""
    regs = {"$2": word & (2**64 - 1), "$3": _bits32(inv), "$4": _bits32(nxs)}

    def val(tok: str) -> int:
        return regs[tok] if tok in regs else int(tok, 0)

    for op, ops in ptx_instructions(ptx):
        if op == "mov.b64":
            parts = [t.strip() for t in ops[0].strip("{}").split(",")]
            width = 64 // len(parts)
            for i, name in enumerate(parts):
                regs[name] = (val(ops[1]) >> (width * i)) & ((1 << width) - 1)
        elif op == "mov.b32":
            regs[ops[0]] = val(ops[1])
        elif op == "shl.b32":
            regs[ops[0]] = (val(ops[1]) << int(ops[2])) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[ops[0]] = val(ops[1]) & val(ops[2])
        elif op == "cvt.f32.f16":
            regs[ops[0]] = _bits32(_f16(val(ops[1])))
        elif op == "mul.rn.f32":
            regs[ops[0]] = _rn32(Fraction(_f32(val(ops[1]))) * Fraction(_f32(val(ops[2]))))
        elif op == "fma.rn.f32":
            a, b, c = (Fraction(_f32(val(t))) for t in ops[1:4])
            regs[ops[0]] = _rn32(a * b + c)
        elif op == "cvt.rn.satfinite.e4m3x2.f32":  # the first source in the upper byte
            regs[ops[0]] = _e4m3(_f32(val(ops[1]))) << 8 | _e4m3(_f32(val(ops[2])))
        elif op == "cvt.rn.f16x2.e4m3x2":  # the low byte in the low half
            b = val(ops[1])
            regs[ops[0]] = _e4m3_f16(b & 0xFF) | _e4m3_f16(b >> 8) << 16
        elif op == "mul.rn.f16x2":
            a, b = val(ops[1]), val(ops[2])
            regs[ops[0]] = _bits16(_f16(a) * _f16(b)) | _bits16(_f16(a >> 16) * _f16(b >> 16)) << 16
        else:
            raise AssertionError(f"run_qx: no evaluator for {op!r}")
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ties", [True, "corrected"])
def test_generated_ptx_computes_the_model(dtype, ties):
    """Each int64 of four values through the PTX gives the fp16 pairs of `qx_ref`'s e4m3
    values times 2^-8 (values 0, 1 in the first pair, low half first): random values and the
    ties, one decided by the correction."""
    h, pm = row(dtype, k=512, seed=2, ties=ties)
    q, xs = fp8_gemv1.qx_ref(h, pm)
    r = (torch.ones(1) / xs).item()
    ptx = fp8_gemv1.qx_ptx(dtype)
    words = h.view(torch.int16).to(torch.int64).reshape(-1, 4) & 0xFFFF
    want = [_e4m3_f16(b) for b in q.view(torch.uint8).reshape(-1).tolist()]
    scale = lambda b: _bits16(_f16(b) * 2.0 ** -8)  # noqa: E731
    for i, w4 in enumerate(words.tolist()):
        word = w4[0] | w4[1] << 16 | w4[2] << 32 | w4[3] << 48
        got = run_qx(ptx, word, r, -xs.item())
        assert got == (scale(want[4 * i]) | scale(want[4 * i + 1]) << 16,
                       scale(want[4 * i + 2]) | scale(want[4 * i + 3]) << 16), i


def test_ptx_costs_five_and_a_half_instructions_a_value():
    for dtype in (torch.bfloat16, torch.float16):
        asm = fp8_gemv1.qx_ptx(dtype)
        ops = [op for op, _ in ptx_instructions(asm)]
        assert ops.count("mul.rn.f32") == 4 and ops.count("fma.rn.f32") == 8
        assert ops.count("cvt.rn.satfinite.e4m3x2.f32") == 2 and ops.count("cvt.rn.f16x2.e4m3x2") == 2
        assert ops.count("mul.rn.f16x2") == 2
        widen = [o for o in ops if o in ("shl.b32", "and.b32", "cvt.f32.f16")]
        assert len(widen) == 4  # one a value; the movs split registers (no instruction in SASS)
    with pytest.raises(ValueError, match="float32"):
        fp8_gemv1.qx_ptx(torch.float32)


# --- what it takes, and the route ---------------------------------------------------------

def _pending(h, pm, kind="fp8", qmax=448.0, cuda=True):
    return SimpleNamespace(h=h, pmax=pm, kind=kind, qmax=qmax, is_cuda=cuda)


def test_takes_pending_rows_of_one_token_in_16_bits(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    h, pm = row(torch.bfloat16)
    w, ws = torch.zeros(64, 4096).to(E4M3), torch.ones(64)
    assert fp8_gemv1.takes_pending(_pending(h, pm), w, ws)
    assert fp8_gemv1.takes_pending(_pending(h.half(), pm), w, ws)
    assert not fp8_gemv1.takes_pending(_pending(h, pm, cuda=False), w, ws)
    assert not fp8_gemv1.takes_pending(_pending(h.float(), pm), w, ws)  # fp32 rows: act_quant's path
    assert not fp8_gemv1.takes_pending(_pending(h, pm, kind="int8", qmax=127.0), w, ws)
    assert not fp8_gemv1.takes_pending(_pending(h, pm, qmax=240.0), w, ws)  # another clamp than satfinite's
    assert not fp8_gemv1.takes_pending(_pending(torch.cat([h, h]), torch.cat([pm, pm])), w, ws)  # two rows
    assert not fp8_gemv1.takes_pending(_pending(torch.cat([h, h], 1)[:, ::2], pm), w, ws)  # strided
    assert not fp8_gemv1.takes_pending(_pending(h, pm.double()), w, ws)
    assert not fp8_gemv1.takes_pending(_pending(h, pm), torch.zeros(66, 4096).to(E4M3), torch.ones(66))
    assert not fp8_gemv1.takes_pending(_pending(h, pm), w, ws[:-1])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert not fp8_gemv1.takes_pending(_pending(h, pm), w, ws)
    with pytest.raises(ValueError, match="qmax 448"):
        fp8_gemv1.fp8_gemv1_pending_launch(_pending(h, pm, qmax=240.0), w, ws)
    with pytest.raises(ValueError, match=r"\[1, K=4096\]"):
        fp8_gemv1.fp8_gemv1_pending_launch(_pending(h.float(), pm), w, ws)


def test_a_pending_row_goes_to_the_kernel_at_one_row(monkeypatch):
    """`prequantized_product` hands a pending row that `takes_pending` takes to
    `fp8_gemv1_pending_launch`; a split K folded in or left pending, or `ONE_ROW_FP8` off,
    keep the swap-AB kernel's own quantization on load."""
    from atom.model_ops.kernels import quant_gemv_dot as qgd
    calls = []
    monkeypatch.setattr(common, "route_for", lambda *a: "dot")
    monkeypatch.setattr(fp8_gemv1, "takes_pending", lambda p, w, ws: True)
    monkeypatch.setattr(fp8_gemv1, "fp8_gemv1_pending_launch", lambda p, w, ws, bias, out_dtype:
                        calls.append("h2") or torch.zeros(1, w.shape[0], dtype=out_dtype))
    monkeypatch.setattr(qgd, "quant_gemv_dot_pending_launch", lambda p, w, ws, bias, out_dtype, **k:
                        calls.append("dot") or torch.zeros(1, w.shape[0], dtype=out_dtype))
    h, pm = row(torch.bfloat16)
    p = PendingQuant(h, pm, "fp8", 448.0)
    w, ws = torch.zeros(64, 4096).to(E4M3), torch.ones(64, 1)
    common.prequantized_product(p, None, w, ws, None, torch.bfloat16)
    common.prequantized_product(p, None, w, ws, None, torch.bfloat16, lock=torch.zeros(4, dtype=torch.int32))
    common.prequantized_product(p, None, w, ws, None, torch.bfloat16, defer_sum=True)
    monkeypatch.setattr(common, "ONE_ROW_FP8", False)
    common.prequantized_product(p, None, w, ws, None, torch.bfloat16)
    assert calls == ["h2", "dot", "dot", "dot"]
    calls.clear()  # the start-up tile choice times the plain kernel: a pending row keeps the table's tile
    monkeypatch.setattr(common, "ONE_ROW_FP8", True)
    common.prequantized_product(p, None, w, ws, None, torch.bfloat16,
                                plan=KernelPlan(fp8_tiles={(64, 4096): (8, 128, 4, 2, True)}))
    assert calls == ["h2"]


# --- on a GPU -----------------------------------------------------------------------------

@pytest.mark.gpu
@GPU_ONLY
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,parts", [(4096, 4096, 32), (4096, 14336, 14), (6144, 4096, 1), (512, 2048, 16)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_gpu_kernel_quantizing_on_load_gives_the_quantizers_bits(dtype, n, k, parts, with_bias):
    """Llama-3.1-8B's o_proj (32 head amaxes) and down (14 chunk amaxes), a one-partial row and
    a small shape: the same bits as `act_quant` then `fp8_gemv1_launch` with three tiles that
    cover the shape; e4m3's ties (one decided by the correction) and a row under the 1e-12 floor
    among the rows."""
    from test_fp8_gemv1 import _operands

    from atom.model_ops.kernels.act_quant import act_quant
    w8, ws = _operands(n, k)[2:]
    bias = torch.randn(n, device="cuda").to(dtype) if with_bias else None
    rows = [row(dtype, k, seed=1)[0], row(dtype, k, seed=2, ties=True)[0], row(dtype, k, seed=4, ties="corrected")[0],
            (row(dtype, k, seed=3)[0].float() * 1e-15).to(dtype)]
    for h in rows:
        h = h.cuda()
        chunks = torch.tensor_split(h.float().abs(), parts, dim=1)
        pm = torch.stack([c.amax(1) for c in chunks], dim=1).contiguous()
        p = PendingQuant(h, pm, "fp8", 448.0)
        assert fp8_gemv1.takes_pending(p, w8, ws)
        xq, xs = act_quant(h, "fp8", k, 448.0)
        for tile in {fp8_gemv1.tile_for(n, k), (4, 128, 4, 2, True), (8, 128, 4, 1, False)}:
            if not fp8_gemv1.even(n, k, tile):
                continue
            want = fp8_gemv1.fp8_gemv1_launch(xq, xs.reshape(-1).float(), w8, ws, bias, out_dtype=dtype, tile=tile)
            got = fp8_gemv1.fp8_gemv1_pending_launch(p, w8, ws, bias, out_dtype=dtype, tile=tile)
            assert torch.equal(got, want), tile


@pytest.mark.gpu
@GPU_ONLY
def test_gpu_down_quantizes_silu_rows_on_load_in_the_one_row_kernel(monkeypatch):
    """"quant_on_load" at one row with `ONE_ROW_FP8` on: down's product (K 2048, SiLU-and-mul's
    rows split) runs `fp8_gemv1_pending_launch` on SiLU-and-mul's rows and partials, with the
    bits of the plan without it (its quantizer, then `fp8_gemv1_launch`) and no quantizer launch
    in between; 3 and 80 rows keep the quantizer (`_check_quant_on_load`, without its deferred
    swap-AB sum, which the one-row kernel does not leave)."""
    from test_quant_fusions import _check_quant_on_load, _count
    calls = []
    _count(monkeypatch, fp8_gemv1, "fp8_gemv1_pending_launch", calls)
    _check_quant_on_load("fp8_channel", "cuda", monkeypatch, defer=False)
    assert calls == ["fp8_gemv1_pending_launch"]  # the one-row step's down, once


@pytest.mark.gpu
@GPU_ONLY
def test_gpu_engine_quantizing_on_load_generates_the_default_tokens(tmp_path, monkeypatch):
    """A ptpc FP8 dummy Llama whose o_proj (K 2048) and down (SiLU rows of 2048, split) take the
    one-row kernel, in CUDA graphs: with "quant_on_load" added to the default fusions its
    one-row steps run `fp8_gemv1_pending_launch` and it generates exactly the default engine's
    tokens (the same bits in every product)."""
    import json

    import transformers

    from atom import LLM, SamplingParams
    from atom.benchmarks.quant_formats import get_format
    from atom.model_engine import model_runner
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=2048, intermediate_size=2048, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024,
                                   tie_word_embeddings=False, torch_dtype="bfloat16",
                                   architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["quantization_config"] = get_format("fp8_dynamic").quantization_config()
    (tmp_path / "config.json").write_text(json.dumps(data))
    prompts = [[5, 6, 7, 8, 9], list(range(100, 140))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    launch, ran = fp8_gemv1.fp8_gemv1_pending_launch, []
    monkeypatch.setattr(fp8_gemv1, "fp8_gemv1_pending_launch", lambda *a, **k: ran.append(1) or launch(*a, **k))
    tokens = {}
    defaults = model_runner.default_fusions
    for name in ("default", "quant_on_load"):
        if name == "quant_on_load":  # (the runner's plan at start-up, before its graphs)
            monkeypatch.setattr(model_runner, "default_fusions", lambda backend: defaults(backend) + ("quant_on_load",))
        llm = LLM(str(tmp_path), load_dummy="xavier", num_kvcache_blocks=64, enable_log_stats=False)
        assert llm.engine.runner.graphs is not None
        tokens[name] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert bool(ran) == (name == "quant_on_load"), name
        del llm
    assert tokens["quant_on_load"] == tokens["default"]
