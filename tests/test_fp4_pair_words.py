"""MXFP4 pair words (`kernels.fp4_pairs`, the plan's "fp4_pair_words") and the one-row GEMV's
fp16 pair chains (`kernels.h2_ptx`, `w4_gemv1`'s CHAIN): the layout round trip and decode, the
generated PTX run by a small evaluator against `w4_gemv1.half2_ref`, the GEMV on pair words under
the interpreter (the float32 path) against MXFP4's bits, the linear method's one-row route, the
fusion's install, and (marked gpu) the HALF2 kernel against its reference arithmetic."""
from __future__ import annotations

import re
import types

import numpy as np
import pytest
import torch

import atom.model_ops.quant.mxfp4 as mxfp4_mod
from atom.model_ops.kernels import fp4_pairs, h2_ptx, w4_gemm, w4_gemv1
from atom.model_ops.kernels.w4_gemm import w4_linear_launch, w4_linear_ref
from atom.model_ops.quant.mxfp4 import FP4_VALUES
from test_quant_kernels_4bit import LAYERS, TOL, half2_x, random_w4, rel_err


def words_of(n: int, m: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31 - 1, (n, m), generator=g, dtype=torch.int64).to(torch.int32)


def codes_of(words: torch.Tensor) -> torch.Tensor:
    """[..., W] int32 -> [..., W, 8] codes, column i at bits 4i..4i+3."""
    return ((words.to(torch.int64) & 0xFFFFFFFF)[..., None] >> torch.arange(0, 32, 4)) & 0xF


def test_pair_words_place_every_bit_once_and_convert_back():
    placed = sorted(pair + b for _, pair, n in fp4_pairs.MOVES for b in range(n))
    taken = sorted(std + b for std, _, n in fp4_pairs.MOVES for b in range(n))
    assert placed == taken == list(range(32))
    w = torch.cat([words_of(16, 9, 0), torch.tensor([[0, -1, 2 ** 31 - 1, -2 ** 31, 0x12345678, 0x7, 0x8, 0xF,
                                                      0x88888888 - 2 ** 32]], dtype=torch.int32)])
    p = fp4_pairs.pair_words(w)
    assert p.dtype == torch.int32 and p.shape == w.shape and not torch.equal(p, w)
    assert torch.equal(fp4_pairs.standard_words(p), w)
    with pytest.raises(ValueError, match="int32"):
        fp4_pairs.pair_words(w.to(torch.int64))


def test_pair_decode_gives_every_code_in_every_column():
    """The kernel's decode (one or two masks of one or two shifted words a pair) reads each
    code as e2m1 x 2^-14 exactly, in each of the 8 columns, for all 16 codes."""
    every = torch.tensor([sum(c << (4 * i) for i in range(8)) for c in range(16)], dtype=torch.int64)
    mixed = torch.tensor([sum(((c + i) % 16) << (4 * i) for i in range(8)) for c in range(16)], dtype=torch.int64)
    w = torch.where(torch.cat([every, mixed]) >= 2 ** 31, torch.cat([every, mixed]) - 2 ** 32,
                    torch.cat([every, mixed])).to(torch.int32).reshape(2, 16)
    got = fp4_pairs.pair_values(fp4_pairs.pair_words(w))
    assert torch.equal(got, FP4_VALUES[codes_of(w)] * 2.0 ** -14)
    rand = words_of(8, 64, 1)
    assert torch.equal(fp4_pairs.pair_values(fp4_pairs.pair_words(rand)), FP4_VALUES[codes_of(rand)] * 2.0 ** -14)


# --- the generated PTX, evaluated --------------------------------------------------------

def _h(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def _bits16(v: float) -> int:
    return int(np.array([v], dtype=np.float16).view(np.uint16)[0])


def ptx_instructions(ptx: str):
    """(opcode, operands) of each instruction of an inline-asm body (braces, directives and
    register declarations skipped; a {a, b} vector operand stays one operand)."""
    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        yield op, [t.strip() for t in re.split(r",(?![^{]*})", rest)]


def run_ptx(ptx: str, args: list[int]) -> float:
    """Evaluates the inline-asm body `h2_ptx` generates (its instructions only), operands
    $1.. = args (int32 bits); returns $0 as a float32. fp16 operations round each result once
    to fp16 (products of two fp16 and a sum with an fp16 are exact in float64 first)."""
    regs = {f"${i + 1}": a & 0xFFFFFFFF for i, a in enumerate(args)}

    def val(tok: str) -> int:
        return regs[tok] if tok in regs else int(tok, 0) & 0xFFFFFFFF

    def pair(tok: str) -> tuple[float, float]:
        b = val(tok)
        return _h(b), _h(b >> 16)

    for op, ops in ptx_instructions(ptx):
        if op == "shl.b32":
            regs[ops[0]] = (val(ops[1]) << int(ops[2])) & 0xFFFFFFFF
        elif op == "shr.u32":
            regs[ops[0]] = val(ops[1]) >> int(ops[2])
        elif op == "and.b32":
            regs[ops[0]] = val(ops[1]) & val(ops[2])
        elif op == "or.b32":
            regs[ops[0]] = val(ops[1]) | val(ops[2])
        elif op == "mov.b32" and ops[0].startswith("{"):
            lo, hi = (t.strip() for t in ops[0].strip("{}").split(","))
            regs[lo], regs[hi] = val(ops[1]) & 0xFFFF, val(ops[1]) >> 16
        elif op == "mov.b32":
            regs[ops[0]] = val(ops[1])
        elif op in ("mul.rn.f16x2", "fma.rn.f16x2"):
            a, b = pair(ops[1]), pair(ops[2])
            c = pair(ops[3]) if op.startswith("fma") else (0.0, 0.0)
            lo, hi = (_bits16(a[k] * b[k] + c[k]) for k in (0, 1))
            regs[ops[0]] = lo | hi << 16
        elif op == "add.rn.f16":
            regs[ops[0]] = _bits16(_h(val(ops[1])) + _h(val(ops[2])))
        elif op == "cvt.f32.f16":
            regs[ops[0]] = int(np.array([_h(val(ops[1]))], dtype=np.float32).view(np.uint32)[0])
        else:
            raise AssertionError(f"run_ptx: no evaluator for {op!r}")
    return float(np.array([regs["$0"]], dtype=np.uint32).view(np.float32)[0])


def x_pairs(xs: torch.Tensor) -> list[int]:
    """fp16 x of one word's 8 columns -> the 4 pair operands (i, i + 4) as int32 bits."""
    b = xs.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    return [int(b[i] | b[i + 4] << 16) for i in range(4)]


def chain_ref(words: torch.Tensor, xs: list[list[int]], fmt: str) -> float:
    """One run of words (int32 [W], in `fmt`'s layout) against the x pair operands, as the
    module docstring of `h2_ptx` says: fp16 FMAs word by word, pair by pair, per half, the
    halves added in fp16; as a float."""
    std = fp4_pairs.standard_words(words) if fmt == "mxfp4_pairs" else words
    codes = codes_of(std)
    if fmt == "int4":  # u 2^-24, odd nibbles 16 u 2^-24
        vals = codes.double() * torch.tensor([1.0, 16.0] * 4, dtype=torch.float64) * 2.0 ** -24
    else:
        vals = FP4_VALUES[codes].double() * 2.0 ** -14
    acc = [0.0, 0.0]
    for k in range(words.shape[0]):
        for i in range(4):
            for half, col in ((0, i), (1, i + 4)):
                acc[half] = float(np.float16(float(vals[k, col]) * _h(xs[k][i] >> (16 * half)) + acc[half]))
    return float(np.float32(np.float16(acc[0] + acc[1])))


def scaled_x(x: torch.Tensor, fmt: str) -> tuple[list[list[int]], int]:
    """x [W * 8] of one run scaled as the kernel does (`_h2_pairs`: by 2^(141 - e), odd int4
    columns / 16) -> the pair operands of each word and e."""
    xf = x.float().reshape(-1, 8)
    e = max(int((xf.abs().max().view(torch.int32) >> 23).item()), 40)
    sc = torch.tensor([(268 - e) << 23], dtype=torch.int32).view(torch.float32)
    odd = torch.tensor([1.0, 0.0625] * 4 if fmt == "int4" else [1.0] * 8)
    return [x_pairs(w * sc * odd) for w in xf], e


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "mxfp4_pairs"])
@pytest.mark.parametrize("words", [1, 2])
def test_generated_ptx_computes_the_chain(fmt, words):
    """Each word (or word pair, CHAIN) through the PTX `h2_ptx` generates, run by the
    evaluator, equals the chain computed from the codes' values, bit for bit (every code,
    x with outliers)."""
    torch.manual_seed(words)
    w = words_of(6, 4, 7 + words)
    x = torch.randn(4 * 8) * 3
    x[::13] *= 300
    ptx = h2_ptx.h2_ptx(fmt, words)
    for row in range(6):
        for r in range(0, 4, words):
            xs, _ = scaled_x(x[8 * r:8 * (r + words)].bfloat16(), fmt)
            run = w[row, r:r + words]
            got = run_ptx(ptx, [int(v) for v in run] + sum(xs, []))
            assert got == chain_ref(run, xs, fmt), (row, r)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("chain", [1, 2])
def test_half2_ref_sums_the_chains(fmt, chain):
    """`half2_ref` (unit scales, no zero points) is the sum of each run's chain times 2^(e - 127)
    (int4: 2^(e - 117), less 8 sum x for the symmetric zero point): the kernel's unscaling."""
    n_words = 8
    w = words_of(3, n_words, 11)
    x = (torch.randn(1, 8 * n_words) * 2).bfloat16()
    g = 32 if fmt == "mxfp4" else 64
    scales = torch.full((3, 8 * n_words // g), 127 if fmt == "mxfp4" else 1,
                        dtype=torch.uint8 if fmt == "mxfp4" else torch.float32)
    got = w4_gemv1.half2_ref(x, w, scales, None, None, g, fmt, chain)
    for row in range(3):
        want = 0.0
        for r in range(0, n_words, chain):
            xr = x[0, 8 * r:8 * (r + chain)]
            xs, e = scaled_x(xr, fmt)
            t = chain_ref(w[row, r:r + chain], xs, fmt)
            want += t * 2.0 ** (e - 127) if fmt == "mxfp4" else t * 2.0 ** (e - 117) - 8 * float(xr.double().sum())
        assert float(got[0, row]) == pytest.approx(want, rel=1e-6), row


def test_generated_ptx_decodes_pair_words_with_fewer_instructions():
    """The decode a word takes in PTX (shifts, masks, ors; products and the tail excluded): 19
    for MXFP4's layout, 13 for pair words (15 and 11 in sm90 SASS, where a mask and the or after
    it become one LOP3); eight fp16 pair products in a chain of two words, the first a
    multiply."""
    def decode_ops(ptx: str) -> int:
        return sum(1 for line in ptx.splitlines() if re.match(r"\s*(shl|shr|and|or)\.", line))
    assert decode_ops(h2_ptx.h2_ptx("mxfp4")) == 19
    assert decode_ops(h2_ptx.h2_ptx("mxfp4_pairs")) == 13
    two = h2_ptx.h2_ptx("mxfp4_pairs", 2)
    assert two.count("fma.rn.f16x2") == 7 and two.count("mul.rn.f16x2") == 1 and two.count("cvt.f32.f16") == 1
    assert h2_ptx.constraints(2) == "=r," + ",".join(["r"] * 10)
    with pytest.raises(ValueError, match="fmt"):
        h2_ptx.h2_ptx("nvfp4")


# --- half2_ref's chains --------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["plain", "outliers", "tiny", "zero_words"])
@pytest.mark.parametrize("fmt, N, K, g, zp", [("int4", 64, 4096, 128, False), ("int4", 32, 1024, 32, True),
                                              ("mxfp4", 64, 4096, 32, False), ("mxfp4", 16, 14336, 32, False)])
def test_two_word_chains_stay_below_bf16_rounding(fmt, N, K, g, zp, kind):
    """CHAIN's arithmetic (`half2_ref(chain=2)`: x scaled per 16 columns, eight fp16 FMAs a
    half): under 1.5e-3 of the largest output against the exact product, as one-word chains
    are (2e-3 is bf16's output rounding), and not the one-word chains' bits."""
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, seed=K + g)
    x = half2_x(K, kind)
    exact = w4_linear_ref(x.float(), packed, scales, zeros, None, fmt, g, K)
    words = packed if fmt == "int4" else packed.view(torch.int32)
    one = w4_gemv1.half2_ref(x, words, scales, zeros, None, g, fmt)
    two = w4_gemv1.half2_ref(x, words, scales, zeros, None, g, fmt, chain=2)
    assert rel_err(two, exact) < 1.5e-3
    assert kind == "zero_words" or not torch.equal(one, two)
    pairs = w4_gemv1.half2_ref(x, fp4_pairs.pair_words(words), scales, zeros, None, g, "mxfp4_pairs", chain=2) \
        if fmt == "mxfp4" else two
    assert torch.equal(pairs, two)
    with pytest.raises(ValueError, match="chain"):
        w4_gemv1.half2_ref(x[:, :24], words[:, :3], scales, zeros, None, g, fmt, chain=2)


# --- the GEMV on pair words (interpreter: the float32 path) -----------------------------------

@pytest.mark.parametrize("cfg", [dict(BLOCK_N=2, BLOCK_W=32, num_warps=1), dict(BLOCK_N=4, BLOCK_W=32, num_warps=1,
                                                                                AHEAD=True),
                                 dict(BLOCK_N=4, BLOCK_W=32, num_warps=1, AHEAD=True, DW=2, CHAIN=True)],
                         ids=["masked", "ahead", "dw2"])
@pytest.mark.parametrize("N, K", [(8, 1024), (5, 1280), (8, 2048)])
def test_gemv_on_pair_words_gives_mxfp4_bits(N, K, cfg):
    """`w4_gemv1` on pair words (fmt "mxfp4_pairs": put back in the checkpoint's layout in
    the float32 path) gives the bits of the same weights in MXFP4's layout, with even and
    ragged tiles, words ahead, two words a load (CHAIN needs HALF2: dropped here)."""
    packed, scales, _ = random_w4("mxfp4", N, K, 32, False, seed=N + K)
    x = (torch.randn(1, K) * 3).bfloat16()
    cfg = dict(cfg, kernel="w4_gemv1", num_stages=1)
    ref = w4_linear_launch(x, packed, scales, None, None, "mxfp4", 32, K, config=dict(cfg))
    got = w4_linear_launch(x, fp4_pairs.pair_words(packed.view(torch.int32)), scales, None, None, "mxfp4_pairs",
                           32, K, config=dict(cfg))
    assert torch.equal(got, ref)
    assert rel_err(got, w4_linear_ref(x, packed, scales, None, None, "mxfp4", 32, K)) < TOL[torch.bfloat16]


def test_fold_is_for_pair_words_and_leaves_the_float32_path_alone():
    """The kernel's FOLD (the launcher sets it from `FOLD_PAIR_SCALES` for pair words): refused
    for another format, naming it; on the float32 path (the interpreter), where it does not
    apply, the same bits with and without it."""
    packed, scales, _ = random_w4("mxfp4", 8, 512, 32, False, seed=11)
    x = torch.randn(1, 512).bfloat16()
    cfg = dict(BLOCK_N=4, BLOCK_W=32, num_warps=1, kernel="w4_gemv1", num_stages=1)
    with pytest.raises(ValueError, match="FOLD folds MXFP4 pair words.*'mxfp4'"):
        w4_linear_launch(x, packed, scales, None, None, "mxfp4", 32, 512, config=dict(cfg, FOLD=True))
    pw = fp4_pairs.pair_words(packed.view(torch.int32))
    on = w4_linear_launch(x, pw, scales, None, None, "mxfp4_pairs", 32, 512, config=dict(cfg, FOLD=True))
    off = w4_linear_launch(x, pw, scales, None, None, "mxfp4_pairs", 32, 512, config=dict(cfg, FOLD=False))
    assert torch.equal(on, off)


def test_fused_norm_gemv_on_pair_words_gives_mxfp4_bits():
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_fused
    packed, scales, _ = random_w4("mxfp4", 8, 1024, 32, False, seed=3)
    x, res, nw = torch.randn(1, 1024), torch.randn(1, 1024), torch.rand(1024) + 0.5
    a = w4_gemv1_fused(x, res, nw, 1e-6, packed, scales, None, "mxfp4", 32, 1024)
    b = w4_gemv1_fused(x, res, nw, 1e-6, fp4_pairs.pair_words(packed.view(torch.int32)), scales, None,
                       "mxfp4_pairs", 32, 1024)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("legacy", [False, True], ids=["table", "gemv_gemm"])
@pytest.mark.parametrize("M", [1, 3, 17, 64])
@pytest.mark.parametrize("N, K", [(12, 96), (9, 160), (16, 512)])
def test_every_kernel_reads_pair_words(N, K, M, legacy):
    """The 4-bit op on pair words (fmt "mxfp4_pairs") at every M, through the table's kernels
    (the one-row GEMV, w4_gemv, w4_dot) and the GEMV / GEMM the table replaced: MXFP4's bits
    (each decodes the codes from their own places, or puts the word back first)."""
    packed, scales, _ = random_w4("mxfp4", N, K, 32, False, seed=N + K + M)
    torch.manual_seed(M)
    x = torch.randn(M, K).bfloat16()
    pw = fp4_pairs.pair_words(packed.view(torch.int32))
    cfg = None
    if legacy:
        name, cfg = ("w4_gemv", dict(w4_gemm.GEMV_TILES, BLOCK_M=4)) if M <= 4 else ("w4_gemm", w4_gemm.GEMM_TILES[0][1])
        cfg = dict(cfg, kernel=name)
    got = w4_linear_launch(x, pw, scales, None, None, "mxfp4_pairs", 32, K, config=cfg)
    want = w4_linear_launch(x, packed, scales, None, None, "mxfp4", 32, K, config=cfg)
    assert torch.equal(got, want)
    assert w4_gemm.w4_config(M, N, K, torch.bfloat16, 32, "mxfp4_pairs")[0] == \
        w4_gemm.w4_config(M, N, K, torch.bfloat16, 32, "mxfp4")[0]


@pytest.mark.parametrize("M, split, order", [(1, 1, 0), (3, 2, 1), (17, 2, 0), (17, 1, 1)])
@pytest.mark.parametrize("N, K", [(72, 256), (24, 96)])
def test_w4_dot_reads_pair_words(N, K, M, split, order):
    """The tensor-core kernel's unpack of pair words (each code from its own places, both column
    orders, split K): MXFP4's bits."""
    packed, scales, _ = random_w4("mxfp4", N, K, 32, False, seed=N + M)
    x = torch.randn(M, K).bfloat16()
    cfg = dict(kernel="w4_dot", BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=split, ORDER=order, num_warps=4,
               num_stages=2)
    want = w4_linear_launch(x, packed, scales, None, None, "mxfp4", 32, K, config=dict(cfg))
    got = w4_linear_launch(x, fp4_pairs.pair_words(packed.view(torch.int32)), scales, None, None, "mxfp4_pairs",
                           32, K, config=dict(cfg))
    assert torch.equal(got, want)


def test_pair_words_arguments_and_reference():
    packed, scales, _ = random_w4("mxfp4", 8, 256, 32, False)
    pw = fp4_pairs.pair_words(packed.view(torch.int32))
    with pytest.raises(ValueError, match="int32"):
        w4_linear_launch(torch.randn(1, 256), packed, scales, None, None, "mxfp4_pairs", 32, 256)
    with pytest.raises(ValueError, match="group"):
        w4_linear_launch(torch.randn(1, 256), pw, scales, None, None, "mxfp4_pairs", 64, 256)
    assert torch.equal(w4_gemm.dequantize_w4(pw, scales, None, "mxfp4_pairs", 32, 256),
                       w4_gemm.dequantize_w4(packed, scales, None, "mxfp4", 32, 256))


def test_fold_range_makes_one_exact_float_of_both_scales():
    """The one-row GEMV's folded scale on pair words (`w4_gemv1._h2_part`, FMT 2 with
    `FOLD_PAIR_SCALES`): for every x column exponent e the kernel forms (40..254) and every scale
    byte s in `FOLD_SCALES`, the float32 whose bits are s 2^23 + ((e - 127) << 23) (int32
    arithmetic) is 2^(e - 127) 2^(s - 127) exactly; one byte below or above the range breaks it
    for some e (the range is tight)."""
    e = torch.arange(40, 255, dtype=torch.int64)[:, None]

    def folded(s: torch.Tensor) -> torch.Tensor:
        bits = (s * 2 ** 23 + ((e - 127) << 23)) & 0xFFFFFFFF
        return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32).double()

    lo, hi = fp4_pairs.FOLD_SCALES
    s = torch.arange(lo, hi + 1, dtype=torch.int64)[None, :]
    assert torch.equal(folded(s), torch.exp2((e + s - 254).double()))
    for edge in (lo - 1, hi + 1):
        s = torch.tensor([[edge]])
        assert not torch.equal(folded(s), torch.exp2((e + s - 254).double()))


def test_fold_scales_sets_zero_blocks_and_refuses_other_bytes():
    words = words_of(3, 16, seed=5)
    words[0, 4:8] = 0                   # block 1 of row 0: every code +0
    words[2, 8:12] = -0x77777778        # 0x88888888: every code -0
    scales = torch.full((3, 4), 120, dtype=torch.uint8)
    scales[0, 1], scales[2, 2] = 0, 255
    got = fp4_pairs.fold_scales(words, scales)
    want = scales.clone()
    want[0, 1] = want[2, 2] = fp4_pairs.ZERO_BLOCK_SCALE
    assert torch.equal(got, want) and scales[0, 1] == 0  # a new tensor
    lo, hi = fp4_pairs.FOLD_SCALES
    for bad in (lo - 1, hi + 1):
        out = scales.clone()
        out[1, 3] = bad  # a block with nonzero codes
        assert fp4_pairs.fold_scales(words, out) is None
    with pytest.raises(ValueError, match="uint8, one per 4 words"):
        fp4_pairs.fold_scales(words, scales[:, :3])


@pytest.mark.parametrize("fold", [True, False])
def test_pair_words_only_with_foldable_scales_whatever_the_flag(monkeypatch, fold):
    """`use_pair_words` where it repacks (the platform check forced, as on a GPU), with
    `w4_gemv1.FOLD_PAIR_SCALES` on or off alike: an all-zero block's scale byte becomes 127, the
    dequantized weight the same; a layer with another block's byte outside `FOLD_SCALES` keeps
    the checkpoint's layout and its scales. So every pair-word layer's scales fold, and the flag
    may change after the engine loaded."""
    monkeypatch.setattr(mxfp4_mod.Mxfp4LinearMethod, "_repackable", lambda self, m: not mxfp4_mod._has_pair_words(m))
    monkeypatch.setattr(w4_gemv1, "FOLD_PAIR_SCALES", fold)
    layer = LAYERS["mxfp4"]("linear")
    layer.weight_packed.data[0, :16] = 0  # the first block of row 0: 32 zero codes
    layer.weight_scale.data[0, 0] = 0
    before, scales = layer.method.dequantized_weight(layer), layer.weight_scale.detach().clone()
    assert layer.method.use_pair_words(layer) and layer.method.w4_operands(layer)[3] == "mxfp4_pairs"
    assert layer.weight_scale[0, 0] == fp4_pairs.ZERO_BLOCK_SCALE
    assert torch.equal(layer.weight_scale[:, 1:], scales[:, 1:]) and torch.equal(layer.weight_scale[1:], scales[1:])
    assert torch.equal(layer.method.dequantized_weight(layer), before)
    assert fp4_pairs.fold_scales(fp4_pairs.standard_words(layer.weight_packed.view(torch.int32)),
                                 layer.weight_scale) is not None

    other = LAYERS["mxfp4"]("linear")
    other.weight_scale.data[3, 2] = fp4_pairs.FOLD_SCALES[1] + 1
    assert bool((other.weight_packed[3, 32:48] & 0x77).any())  # the block has a nonzero code
    packed, scales = other.weight_packed.detach().clone(), other.weight_scale.detach().clone()
    assert not other.method.use_pair_words(other) and other.method.w4_operands(other)[3] == "mxfp4"
    assert torch.equal(other.weight_packed, packed) and torch.equal(other.weight_scale, scales)
    # the per-layer table tells the two apart
    assert layer.method.kernel_for(layer).endswith(mxfp4_mod.PAIR_WORDS_NOTE)
    assert mxfp4_mod.PAIR_WORDS_NOTE not in other.method.kernel_for(other)


# --- the method and the fusion --------------------------------------------------------------------

def to_pair_words(layer) -> None:
    """What `use_pair_words` does on a GPU, done on the CPU layer: its bytes as pair words."""
    words = layer.weight_packed.data.view(torch.int32)
    words.copy_(fp4_pairs.pair_words(words))
    layer.fp4_layout = "pairs"


@pytest.mark.parametrize("kind", ["linear", "qkv"])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp4_act_mxfp4"])
def test_layers_on_pair_words_run_every_product_on_them(fmt, kind, monkeypatch):
    """An MXFP4 layer whose bytes are pair words: its dequantized weight is unchanged (the
    torch reference puts them back), and every product, one row or more, goes through the
    kernels as "mxfp4_pairs" with the reference's values; `one_row_operands` hands the fused
    GEMV the pair words. `use_pair_words` leaves CPU layers as they are and is done once."""
    layer = LAYERS[fmt](kind)
    assert not layer.method.use_pair_words(layer)  # CPU weights: the torch reference runs them
    before = layer.method.dequantized_weight(layer)
    xs = [torch.randn(m, layer.in_features).bfloat16() for m in (1, 3, 17)]
    refs = [layer(x) for x in xs]
    to_pair_words(layer)
    assert torch.equal(layer.method.dequantized_weight(layer), before)
    assert layer.method.use_pair_words(layer)  # already converted: nothing to do
    packed, _, _, f, g, k = layer.method.w4_operands(layer)
    assert f == "mxfp4_pairs" and packed.dtype == torch.int32 and packed.shape == (layer.out_features, k // 8)
    if fmt == "mxfp4":
        assert layer.method.one_row_operands(layer)[3] == "mxfp4_pairs"
    fmts = []
    real = w4_gemm.w4_linear_launch
    monkeypatch.setattr(w4_gemm, "w4_linear_launch", lambda *a, **k: fmts.append(a[5]) or real(*a, **k))
    monkeypatch.setattr(mxfp4_mod, "use_w4_kernel", lambda x: True)
    for x, ref in zip(xs, refs):
        assert rel_err(layer(x), ref) < TOL[torch.bfloat16]
    assert fmts == ["mxfp4_pairs"] * 3


def test_the_runner_takes_pair_words_only_before_capture(monkeypatch):
    """`ModelRunner.install_plan` refuses "fp4_pair_words" once CUDA graphs or torch.compile
    have captured the model (they read the checkpoint's layout) where it would still repack a
    layer (`pair_words_pending`); a model without MXFP4 layers, or whose layers are pair words
    already, takes it whatever the plan before (the default plan has it)."""
    from atom.model_engine.model_runner import ModelRunner
    from atom.tuning.plan import KernelPlan
    layer = LAYERS["mxfp4"]("linear")
    method = type(layer.method)
    pending = [True]
    monkeypatch.setattr(method, "pair_words_pending", lambda self, m: pending[0])
    monkeypatch.setattr(method, "use_pair_words", lambda self, m: pending.__setitem__(0, False) or True)
    with_pairs = KernelPlan(backend="triton", fusions=("fp4_pair_words",))
    for captured in (dict(graphs=object()), dict(mixed_graphs=object()), dict(compile_level=3)):
        pending[0] = True
        runner = types.SimpleNamespace(**dict(dict(graphs=None, mixed_graphs=None, compile_level=0), **captured),
                                       plan=KernelPlan(backend="triton"), model=torch.nn.Sequential(layer))
        with pytest.raises(ValueError, match="fp4_pair_words"):
            ModelRunner.install_plan(runner, with_pairs)
        pending[0] = False  # already pair words: re-installing changes nothing
        assert ModelRunner.install_plan(runner, with_pairs) is with_pairs
        dense = types.SimpleNamespace(**dict(dict(graphs=None, mixed_graphs=None, compile_level=0), **captured),
                                      plan=KernelPlan(backend="triton"), model=torch.nn.Sequential(torch.nn.Linear(4, 4)))
        assert ModelRunner.install_plan(dense, with_pairs) is with_pairs  # no MXFP4 layer to repack
    pending[0] = True
    fresh = types.SimpleNamespace(graphs=None, mixed_graphs=None, compile_level=0, plan=None,
                                  model=torch.nn.Sequential(layer))
    assert ModelRunner.install_plan(fresh, with_pairs) is with_pairs and fresh.plan is with_pairs
    assert pending == [False]  # the fusion repacked the layer


def test_pair_words_pending_is_off_the_kernels_platform():
    """On the CPU (the torch reference runs MXFP4 there) no layer is repacked."""
    from atom.tuning import fusions
    layer = LAYERS["mxfp4"]("linear")
    assert not layer.method.pair_words_pending(layer) and not layer.method.use_pair_words(layer)
    assert fusions.pending_pair_words(torch.nn.Sequential(layer)) == 0


def test_the_fusion_gives_mxfp4_layers_their_pair_words(monkeypatch):
    from atom.tuning import fusions
    from atom.tuning.plan import FUSIONS, KernelPlan
    assert "fp4_pair_words" in FUSIONS and "fp4_pair_words" in fusions.default_fusions("triton")
    assert "fp4_pair_words" not in fusions.default_fusions("torch") + fusions.default_fusions("aiter")
    layer = LAYERS["mxfp4"]("linear")
    asked = []
    monkeypatch.setattr(type(layer.method), "use_pair_words", lambda self, m: asked.append(m) or True)
    model = torch.nn.Sequential(layer, torch.nn.Linear(4, 4))
    fusions.install(model, KernelPlan(backend="triton", fusions=("fp4_pair_words",)))
    assert asked == [layer]
    asked.clear()
    fusions.install(model, KernelPlan(backend="triton", fusions=("norm+gemv",)))
    assert asked == []


# --- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("chain", [False, True], ids=["", "chain"])
@pytest.mark.parametrize("fmt, N, K, g, zp", [("mxfp4_pairs", 4096, 4096, 32, False),
                                              ("mxfp4_pairs", 28672, 4096, 32, False),
                                              ("mxfp4_pairs", 4096, 14336, 32, False),
                                              ("mxfp4", 6144, 4096, 32, False), ("int4", 4096, 4096, 128, False),
                                              ("int4", 6144, 4096, 128, True), ("int4", 4096, 14336, 128, False)])
@pytest.mark.parametrize("kind", ["plain", "outliers"])
def test_gpu_pair_words_and_chains_compute_their_reference_arithmetic(fmt, N, K, g, zp, chain, kind):
    """The HALF2 one-row GEMV on the GPU with the table's tiles, two words a load, on pair
    words and / or with CHAIN, against `half2_ref` with the same chain (equal up to the bf16
    output's rounding and float32 sums in another order), and within bf16's tolerance of the
    exact product."""
    base = "mxfp4" if fmt == "mxfp4_pairs" else fmt
    packed, scales, zeros = random_w4(base, N, K, g, zp, device="cuda", seed=K + g)
    words = packed if base == "int4" else packed.view(torch.int32)
    w = fp4_pairs.pair_words(words) if fmt == "mxfp4_pairs" else packed
    x = half2_x(K, kind, torch.bfloat16, "cuda")
    cfg = dict(w4_gemv1.tiles(N, fmt, K), kernel="w4_gemv1", DW=2, CHAIN=chain)
    if (K // 8) % (2 * cfg["BLOCK_W"]):
        cfg.update(BLOCK_W=128, num_warps=4)
    # what the launcher needs to keep DW = 2 and CHAIN (it drops them otherwise)
    assert w4_gemv1.pairs_words(w.view(torch.int32), cfg["BLOCK_N"], cfg["BLOCK_W"], g)
    assert w4_gemv1.half2_applies(x, w4_gemm.FORMATS.index(fmt))
    y = w4_linear_launch(x, w, scales, zeros, None, fmt, g, K, config=cfg)
    h2 = w4_gemv1.half2_ref(x, w if fmt == "mxfp4_pairs" else words, scales, zeros, None, g, fmt,
                            chain=2 if chain else 1)
    assert rel_err(y, h2) < 4e-3
    assert rel_err(y, w4_linear_ref(x, packed, scales, zeros, None, base, g, K)) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_fused_norm_gemv_on_pair_words_matches_mxfp4():
    """`w4_gemv1_fused` (the q/k/v norm GEMV, its HALF2 tile) on pair words gives MXFP4's
    bits: the same fp16 products in the same order, only decoded by other shifts."""
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_fused
    packed, scales, _ = random_w4("mxfp4", 6144, 4096, 32, False, device="cuda", seed=5)
    x = (torch.randn(1, 4096, device="cuda") * 3).bfloat16()
    res, nw = torch.randn(1, 4096, device="cuda").bfloat16(), (torch.rand(4096, device="cuda") + 0.5).bfloat16()
    a = w4_gemv1_fused(x, res, nw, 1e-6, packed, scales, None, "mxfp4", 32, 4096)
    b = w4_gemv1_fused(x, res, nw, 1e-6, fp4_pairs.pair_words(packed.view(torch.int32)), scales, None,
                       "mxfp4_pairs", 32, 4096)
    assert torch.equal(b[0], a[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, g", [("int4", 128), ("mxfp4", 32), ("mxfp4_pairs", 32)])
def test_gpu_fused_norm_gemv_with_chain_matches_its_default_tile(fmt, g):
    """`w4_gemv1_fused` (the q/k/v norm GEMV) with two words a load and CHAIN, a tile its
    table may take: the same norm (residual out bit for bit) and products, within the fp16
    chains' rounding of the default tile's output, and within bf16's tolerance of the
    reference (the norm in float32, then the dequantized product)."""
    from atom.model_ops.kernels.w4_gemv1 import fused_tiles, w4_gemv1_fused
    base = "mxfp4" if fmt == "mxfp4_pairs" else fmt
    N, K = 6144, 4096
    packed, scales, _ = random_w4(base, N, K, g, False, device="cuda", seed=9)
    words = packed if base == "int4" else packed.view(torch.int32)
    w = fp4_pairs.pair_words(words) if fmt == "mxfp4_pairs" else packed
    x = (torch.randn(1, K, device="cuda") * 3).bfloat16()
    res, nw = torch.randn(1, K, device="cuda").bfloat16(), (torch.rand(K, device="cuda") + 0.5).bfloat16()
    cfg = dict(fused_tiles(False), DW=2, CHAIN=True)
    # what the launcher needs to keep DW = 2 and CHAIN (it drops them otherwise)
    assert w4_gemv1.pairs_words(w.view(torch.int32), cfg["BLOCK_N"], cfg["BLOCK_W"], g)
    assert w4_gemv1.half2_applies(x, w4_gemm.FORMATS.index(fmt))
    a = w4_gemv1_fused(x, res, nw, 1e-6, w, scales, None, fmt, g, K)
    b = w4_gemv1_fused(x, res, nw, 1e-6, w, scales, None, fmt, g, K, cfg=cfg)
    assert torch.equal(a[1], b[1])
    assert rel_err(b[0], a[0]) < 4e-3
    h = (x.float() + res.float())
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()).bfloat16()
    assert rel_err(b[0], w4_linear_ref(h, packed, scales, None, None, base, g, K)) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_layer_with_pair_words_matches_mxfp4():
    layer = LAYERS["mxfp4"]("linear").cuda()
    xs = [torch.randn(m, layer.in_features, device="cuda").bfloat16() for m in (1, 3, 17, 300)]
    refs = [layer(x) for x in xs]
    before = layer.weight_packed.clone()
    assert layer.method.use_pair_words(layer) and layer.fp4_layout == "pairs"
    assert torch.equal(fp4_pairs.standard_words(layer.weight_packed.view(torch.int32)), before.view(torch.int32))
    for x, ref in zip(xs, refs):  # the same products and tiles (pair words take MXFP4's)
        assert torch.equal(layer(x), ref), x.shape


@pytest.mark.gpu
@pytest.mark.parametrize("chain", [False, True], ids=["", "chain"])
@pytest.mark.parametrize("N, K", [(4096, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_folded_pair_scales_change_no_bit(N, K, chain):
    """The kernel's FOLD (`FOLD_PAIR_SCALES`) on pair words with the table's tiles, with and without
    CHAIN: scales in `FOLD_SCALES` and an all-zero block whose byte 0 `fold_scales` sets to 127 give
    the bits of the unfolded loop on the checkpoint's scales (each chain's two multiplies by powers
    of two, exact, become one), and `half2_ref`'s arithmetic."""
    packed, scales, _ = random_w4("mxfp4", N, K, 32, False, device="cuda", seed=K + 7)
    words = packed.view(torch.int32)
    words[0, :4] = 0
    scales[0, 0] = 0
    folded_scales = fp4_pairs.fold_scales(words, scales)
    assert folded_scales[0, 0] == fp4_pairs.ZERO_BLOCK_SCALE
    w = fp4_pairs.pair_words(words)
    x = half2_x(K, "outliers", torch.bfloat16, "cuda")
    cfg = dict(w4_gemv1.tiles(N, "mxfp4_pairs", K), kernel="w4_gemv1", DW=2, CHAIN=chain)
    if (K // 8) % (2 * cfg["BLOCK_W"]):
        cfg.update(BLOCK_W=128, num_warps=4)
    plain = w4_linear_launch(x, w, scales, None, None, "mxfp4_pairs", 32, K, config=dict(cfg, FOLD=False))
    folded = w4_linear_launch(x, w, folded_scales, None, None, "mxfp4_pairs", 32, K, config=dict(cfg, FOLD=True))
    assert torch.isfinite(folded).all() and torch.equal(folded, plain)
    h2 = w4_gemv1.half2_ref(x, w, scales, None, None, 32, "mxfp4_pairs", chain=2 if chain else 1)
    assert rel_err(folded, h2) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("fold", [True, False])
def test_gpu_pair_words_pending_only_with_foldable_scales(monkeypatch, fold):
    """On the kernels' platform `pair_words_pending` agrees with `use_pair_words`, with the fold
    on or off: a layer with a scale byte outside `FOLD_SCALES` is not pending (so the runner does
    not refuse the plan after capture for a layer it would never repack); one inside is."""
    monkeypatch.setattr(w4_gemv1, "FOLD_PAIR_SCALES", fold)
    layer = LAYERS["mxfp4"]("linear").cuda()
    layer.weight_scale.data[3, 2] = fp4_pairs.FOLD_SCALES[1] + 1
    assert not layer.method.pair_words_pending(layer) and not layer.method.use_pair_words(layer)
    inside = LAYERS["mxfp4"]("linear").cuda()
    assert inside.method.pair_words_pending(inside) and inside.method.use_pair_words(inside)


def test_layout_frame_lists_each_columns_places():
    """`fp4_pairs.layout_frame`: a row a column, its fields where `MOVES` puts them, and shifts
    that bring them to the fp16 half's places (9-11 and 15 in each half)."""
    frame = fp4_pairs.layout_frame()
    assert list(frame.index) == list(range(8))
    for col, row in frame.iterrows():
        em_lo = int(row["pair_em_bits"].split("-")[0])
        assert (4 * col, em_lo, 3) in fp4_pairs.MOVES and (4 * col + 3, row["pair_sign_bit"], 1) in fp4_pairs.MOVES
        half = 16 * (col // 4)
        assert em_lo + row["em_shift"] == 9 + half and row["pair_sign_bit"] + row["sign_shift"] == 15 + half
