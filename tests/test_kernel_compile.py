"""The Triton kernels' compiled path builds for an NVIDIA sm90 target on any machine.

The interpreter runs the kernels' logic in CI but never compiles them, and never takes the
branches that only a GPU takes (programmatic dependent launch: `griddepcontrol` inline PTX).
Triton compiles ahead of time for a target without a GPU (ptxas ships with it), so this test
builds those kernels for sm90, in a child process where TRITON_INTERPRET is unset (the
kernels of this process may already be interpreted functions), and checks the PTX (PDL's
griddepcontrol instructions; the Triton GEMM's TMA copies and wgmma; the sampler's exp2 and
Philox; the MoE experts' sorted grouped GEMM on tensor cores (mma) and their unsorted path;
the one-row 4-bit GEMV's masked, MXFP4 and loaded-ahead variants, its L2 prefetches, its
loads pipelined through shared memory, its word loads cached in L2 only and its scale rows
prefetched (into L1 too) before the PDL wait; the one-row FP8 product's weight loads cached in
L2 only; how many K tiles the attention keeps in flight at 3 stages, with and without `rows_ahead`;
its FP8-cache dots in fp16 for bf16 queries; its first tile prefetched before the PDL wait; its
split merged by the last segment's program; rows prepared for the 4-bit GEMV and its loops
reading them; the tensor-core probe `scripts/w4_mma_probe.py`).

    python tests/test_kernel_compile.py    # the child: prints one JSON line
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _with_defaults(kernel, constexprs: dict) -> dict:
    """`constexprs` plus the defaults of the kernel's other constexpr parameters (their values
    when a launch leaves them out)."""
    fn = getattr(kernel, "fn", kernel)
    params = getattr(kernel, "params", None) or getattr(fn, "params", [])
    return {**{p.name: p.default for p in params if p.is_constexpr and p.has_default}, **constexprs}


def _signature(kernel, constexprs: dict, types: dict) -> dict:
    """Argument types by name: constexprs as such, `types` where given, else *bf16 for a
    pointer (`*_ptr`) and i32 for the rest."""
    return {a: "constexpr" if a in constexprs else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
            for a in kernel.arg_names}


def _compile_all() -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gemv = importlib.import_module("atom.model_ops.kernels.gemv")
    rotary = importlib.import_module("atom.model_ops.kernels.rotary")
    gemv_rope = importlib.import_module("atom.model_ops.kernels.gemv_rope")
    attn = importlib.import_module("atom.model_ops.attention.triton_unified")
    kv_cache = importlib.import_module("atom.model_ops.kernels.kv_cache")
    gemm = importlib.import_module("atom.model_ops.kernels.gemm")
    rmsnorm = importlib.import_module("atom.model_ops.kernels.rmsnorm")
    activation = importlib.import_module("atom.model_ops.kernels.activation")
    sampling = importlib.import_module("atom.model_ops.kernels.sampling")
    moe = importlib.import_module("atom.model_ops.moe.experts_triton")
    w4g1 = importlib.import_module("atom.model_ops.kernels.w4_gemv1")
    import importlib.util
    spec = importlib.util.spec_from_file_location(  # the tensor-core probe (a script, not a package module)
        "w4_mma_probe", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                                     "w4_mma_probe.py"))
    mma = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mma)
    h2x = importlib.import_module("atom.model_ops.kernels.h2_xpack")
    fp8g1 = importlib.import_module("atom.model_ops.kernels.fp8_gemv1")
    f32, idx = {"eps": "fp32", "scale_log2": "fp32"}, {n: "*i32" for n in ("cu_ptr", "seq_lens_ptr", "bt_ptr", "cnt_ptr")}
    cases = {
        "gemv_fused_gated": (gemv._gemv_kernel, dict(NORM=True, HAS_RES=True, GATED=True, PDL=True, BLOCK_N=1,
                                                     BLOCK_K=1024, AHEAD=False), f32),
        "gemv_plain_ahead": (gemv._gemv_kernel, dict(NORM=False, HAS_RES=False, GATED=False, PDL=True, BLOCK_N=2,
                                                     BLOCK_K=1024, AHEAD=True), f32),
        "gemv_norm_rope": (gemv_rope._gemv_rope_kernel, dict(HALF=64, BLOCK_SIZE=16, HAS_RES=True, PDL=True,
                                                             BLOCK_N=2, BLOCK_K=1024, AHEAD=True),
                           dict(f32, pos_ptr="*i64", slot_ptr="*i64", cs_ptr="*fp32")),
        "rope_kv_write": (rotary._rope_kernel, dict(HQ=32, HQ_PAD=32, HKV=8, HKV_PAD=8, HALF=64, HALF_PAD=64,
                                                    Q_NORM=True, K_NORM=True, WRITE_KV=True, BLOCK_SIZE=16, PDL=True),
                          dict(f32, pos_ptr="*i64", slot_ptr="*i64", cs_ptr="*fp32")),
        "attention_decode_split": (attn._unified_attn_kernel,
                                   dict(QPKV=4, NUM_KV_HEADS=8, HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16, BLOCK_M=16,
                                        BLOCK_Q=4, TILE_N=64, NUM_SPLITS=16, DOT_PREC="tf32", PDL=True,
                                        HAS_SINKS=False, SLIDING=False, KV_FP8=False, EXACT_ROUND=False,
                                        ROWS_AHEAD=False, KV_F16=False),
                                   dict(f32, **idx, po_ptr="*fp32", plse_ptr="*fp32")),
        # GPT-OSS-style layers over an FP8 cache: sinks, a sliding window, e4m3 K/V read and (the
        # decode rope path) written; the fp32 -> e4m3 store is the saturating conversion
        "attention_fp8_window_sinks": (attn._unified_attn_kernel,
                                       dict(QPKV=8, NUM_KV_HEADS=8, HEAD_DIM=64, HEAD_PAD=64, BLOCK_SIZE=16,
                                            BLOCK_M=16, BLOCK_Q=2, TILE_N=64, NUM_SPLITS=4, DOT_PREC="tf32", PDL=True,
                                            ROPE=True, QK_NORM=False, HAS_SINKS=True, SLIDING=True, KV_FP8=True,
                                            EXACT_ROUND=False, ROWS_AHEAD=False, KV_F16=True),
                                       dict(f32, **idx, po_ptr="*fp32", plse_ptr="*fp32", k_ptr="*fp8e4nv",
                                            v_ptr="*fp8e4nv", slot_ptr="*i64", cs_ptr="*fp32", sinks_ptr="*fp32",
                                            ks_ptr="*fp32", vs_ptr="*fp32", norm_eps="fp32"),
                                       ("griddepcontrol.wait", "cvt.rn.satfinite.e4m3x2.f32")),
        "kv_write_fp8": (kv_cache._reshape_and_cache_kernel,
                         dict(NUM_HEADS=8, HEAD_DIM=128, H_PAD=8, D_PAD=128, BLOCK_SIZE=16, KV_FP8=True,
                              EXACT_ROUND=False),
                         dict(kc_ptr="*fp8e4nv", vc_ptr="*fp8e4nv", slot_ptr="*i64", ks_ptr="*fp32", vs_ptr="*fp32"),
                         ("cvt.rn.satfinite.e4m3x2.f32",)),
        "add_rmsnorm": (rmsnorm._rmsnorm_kernel, dict(BLOCK=4096, HAS_RES=True, PDL=True), f32),
        "silu_and_mul": (activation._silu_and_mul_kernel, dict(BLOCK=1024, PDL=True), {}),
        "merge": (attn._merge_kernel, dict(HEAD_DIM=128, HEAD_PAD=128, NUM_SPLITS=16, PDL=True),
                  dict(idx, po_ptr="*fp32", plse_ptr="*fp32")),
        # each head's amax stored beside the output (a product quantizing it on load): the merge
        # and the one-pass decode kernel
        "merge_amax": (attn._merge_kernel, dict(HEAD_DIM=128, HEAD_PAD=128, NUM_SPLITS=16, PDL=True, HAS_AMAX=True),
                       dict(idx, po_ptr="*fp32", plse_ptr="*fp32", amax_ptr="*fp32"),
                       ("griddepcontrol.wait", "abs.bf16")),
        "attention_one_pass_amax": (attn._unified_attn_kernel,
                                    dict(QPKV=4, NUM_KV_HEADS=8, HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16,
                                         BLOCK_M=16, BLOCK_Q=4, TILE_N=64, NUM_SPLITS=1, DOT_PREC="tf32", PDL=True,
                                         ROPE=True, QK_NORM=False, HAS_SINKS=False, SLIDING=False, KV_FP8=False,
                                         EXACT_ROUND=False, ROWS_AHEAD=False, KV_F16=False, HAS_AMAX=True),
                                    dict(f32, **idx, po_ptr="*fp32", plse_ptr="*fp32", slot_ptr="*i64",
                                         cs_ptr="*fp32", norm_eps="fp32", amax_ptr="*fp32"),
                                    ("griddepcontrol.wait", "abs.bf16")),
        # q / k / v as a split-K product's fp32 partials summed as they load (decode, rotary inside)
        "attention_qkv_sum": (attn._unified_attn_kernel,
                              dict(QPKV=4, NUM_KV_HEADS=8, HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16,
                                   BLOCK_M=16, BLOCK_Q=4, TILE_N=64, NUM_SPLITS=16, DOT_PREC="tf32", PDL=True,
                                   ROPE=True, QK_NORM=True, HAS_SINKS=False, SLIDING=False, KV_FP8=False,
                                   EXACT_ROUND=False, ROWS_AHEAD=False, KV_F16=False, HAS_AMAX=False, QKV_SPLITS=4),
                              dict(f32, **idx, q_ptr="*fp32", kn_ptr="*fp32", vn_ptr="*fp32", po_ptr="*fp32",
                                   plse_ptr="*fp32", slot_ptr="*i64", cs_ptr="*fp32", norm_eps="fp32")),
        # the Triton GEMM's TMA path: tiles through the copy engine into the tensor cores
        "gemm_tma": (gemm._gemm_kernel, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, TMA=True,
                                             HAS_BIAS=False, DOT_PREC="tf32"),
                     dict(x="tensordesc<bf16[64,128]>", w="tensordesc<bf16[128,128]>"),
                     ("cp.async.bulk.tensor", "wgmma")),
        # the sampler's two kernels: a block's mass (exp2), then the pick's Philox noise (mul.hi)
        "sampling_block_stats": (sampling._block_stats_kernel, dict(BLOCK=2048, GREEDY=False),
                                 dict(logits_ptr="*bf16", temp_ptr="*fp32", max_ptr="*fp32", sum_ptr="*fp32",
                                      idx_ptr="*i32"), ("ex2.approx",)),
        "sampling_pick": (sampling._pick_kernel, dict(BLOCK=2048, BLOCKS_PAD=64, GREEDY=False),
                          dict(logits_ptr="*bf16", temp_ptr="*fp32", max_ptr="*fp32", sum_ptr="*fp32",
                               idx_ptr="*i32", out_ptr="*i64"), ("mul.hi.u32",)),
        # the MoE experts: the grouped GEMM over pairs sorted by expert, and the unsorted path
        "moe_gemm_sorted": (moe._moe_gemm_kernel,
                            dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, HAS_BIAS=True, MUL_WEIGHT=True,
                                 DOT_PREC="tf32", GATED=False),
                            dict(sorted_ptr="*i32", block_expert_ptr="*i32", rw_ptr="*fp32"), ("mma",)),
        # the first product with SiLU-and-mul inside: gate and up tiles, two accumulators, ex2
        "moe_gemm_gated": (moe._moe_gemm_kernel,
                           dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, HAS_BIAS=False, MUL_WEIGHT=False,
                                DOT_PREC="tf32", GATED=True),
                           dict(sorted_ptr="*i32", block_expert_ptr="*i32", rw_ptr="*fp32"), ("mma", "ex2.approx")),
        "moe_gemv_unsorted": (moe._moe_gemv_kernel, dict(BLOCK_N=64, BLOCK_K=128, HAS_BIAS=False, MUL_WEIGHT=True),
                              dict(ids_ptr="*i64", rw_ptr="*fp32"), ("ld.global",)),
        # the one-row 4-bit GEMV: the masked loop (ragged rows / words, a group that splits a step)
        # with zero points, bias and fp16 x; MXFP4 with fp32 x; the even loop with the next words
        # loaded ahead
        "w4_gemv1_int4_masked": (w4g1._w4_gemv1_kernel, dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=False, FMT=0, GROUP=96, HAS_ZP=True, HAS_BIAS=True, PDL=True, SW=0, SS=0, SZ=0, DW=1,
                                                             BLOCK_N=8, BLOCK_W=128, EVEN=False, AHEAD=False),
                                 dict(x_ptr="*fp16", w_ptr="*i32", s_ptr="*fp16", z_ptr="*i8", b_ptr="*fp16",
                                      y_ptr="*fp16")),
        "w4_gemv1_mxfp4_masked": (w4g1._w4_gemv1_kernel, dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=False, FMT=1, GROUP=32, HAS_ZP=False, HAS_BIAS=False, PDL=True, SW=0, SS=0, SZ=0, DW=1,
                                                              BLOCK_N=8, BLOCK_W=256, EVEN=False, AHEAD=False),
                                  dict(x_ptr="*fp32", w_ptr="*i32", s_ptr="*u8", z_ptr="*u8", y_ptr="*fp32")),
        "w4_gemv1_int4_ahead": (w4g1._w4_gemv1_kernel, dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=False, FMT=0, GROUP=128, HAS_ZP=False, HAS_BIAS=False, PDL=True, SW=0, SS=0, SZ=0, DW=1,
                                                            BLOCK_N=8, BLOCK_W=128, EVEN=True, AHEAD=True),
                                dict(w_ptr="*i32")),
        # int4's even gated loop with the scale and zero-point rows' strides compiled in, the words'
        # at runtime (`FIXED_SCALE_STRIDES`)
        "w4_gemv1_int4_scale_strides": (w4g1._w4_gemv1_kernel, dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=True, FMT=0, GROUP=128, HAS_ZP=True, HAS_BIAS=False, PDL=True, SW=0, SS=32, SZ=32, DW=1,
                                                                    BLOCK_N=8, BLOCK_W=128, EVEN=True, AHEAD=False, HALF2=True),
                                        dict(w_ptr="*i32", z_ptr="*i8")),
        # the fp16 pair products (HALF2): the inline PTX's fp16 pair FMAs and the x pairs' packing
        "w4_gemv1_int4_half2": (w4g1._w4_gemv1_kernel, dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=False, FMT=0, GROUP=128, HAS_ZP=True, HAS_BIAS=False, PDL=True, SW=0, SS=0, SZ=0, DW=1,
                                                             BLOCK_N=8, BLOCK_W=256, EVEN=True, AHEAD=False,
                                                             HALF2=True),
                                dict(w_ptr="*i32", z_ptr="*i8"), ("fma.rn.f16x2", "cvt.rn.f16x2.f32")),
        "w4_gemv1_mxfp4_half2": (w4g1._w4_gemv1_kernel, dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=False, FMT=1, GROUP=32, HAS_ZP=False, HAS_BIAS=False, PDL=True, SW=0, SS=0, SZ=0, DW=1,
                                                              BLOCK_N=8, BLOCK_W=128, EVEN=False, AHEAD=False,
                                                              HALF2=True),
                                 dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8"), ("fma.rn.f16x2", "cvt.rn.f16x2.f32")),
        # MXFP4's even loop with the words ahead and its row strides compiled in
        "w4_gemv1_mxfp4_fixed_strides": (w4g1._w4_gemv1_kernel,
                                         dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=False, FMT=1, GROUP=32, HAS_ZP=False,
                                              HAS_BIAS=False, PDL=True, SW=512, SS=128, SZ=128, BLOCK_N=8,
                                              BLOCK_W=256, EVEN=True, AHEAD=True, HALF2=True, DW=1),
                                         dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8"), ("fma.rn.f16x2",)),
        # MXFP4's table loop: word pairs a load (DW = 2), 8-byte loads
        "w4_gemv1_mxfp4_pairs": (w4g1._w4_gemv1_kernel,
                                 dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=False, FMT=1, GROUP=32, HAS_ZP=False,
                                      HAS_BIAS=False, PDL=True, SW=512, SS=128, SZ=128, BLOCK_N=8, BLOCK_W=128,
                                      EVEN=True, AHEAD=True, HALF2=True, DW=2),
                                 dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8"), ("fma.rn.f16x2", "ld.global.b64")),
        # the tile options that change only how the weights travel: L2 prefetches of the step two
        # ahead (L2D: words, scales and zero points, int4 with the words ahead) and MXFP4's word
        # pairs pipelined through shared memory (STAGES: asynchronous copies) with L2D
        "w4_gemv1_int4_l2_prefetch": (w4g1._w4_gemv1_kernel,
                                      dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=False, FMT=0, GROUP=128,
                                           HAS_ZP=True, HAS_BIAS=False, PDL=True, SW=0, SS=0, SZ=0, BLOCK_N=8,
                                           BLOCK_W=128, EVEN=True, AHEAD=True, HALF2=True, DW=1, L2D=2),
                                      dict(w_ptr="*i32", z_ptr="*i8"), ("prefetch.global.L2", "griddepcontrol.wait")),
        "w4_gemv1_mxfp4_stages": (w4g1._w4_gemv1_kernel,
                                  dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=False, FMT=1, GROUP=32,
                                       HAS_ZP=False, HAS_BIAS=False, PDL=True, SW=0, SS=0, SZ=0, BLOCK_N=8,
                                       BLOCK_W=128, EVEN=True, AHEAD=False, HALF2=True, DW=2, STAGES=3, L2D=2),
                                  dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8"),
                                  ("cp.async.ca.shared.global", "cp.async.wait_group", "prefetch.global.L2")),
        # the word loads cached in L2 only (WCACHE ".cg"), MXFP4 word pairs with the words ahead
        "w4_gemv1_mxfp4_words_cg": (w4g1._w4_gemv1_kernel,
                                    dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=False, FMT=1, GROUP=32,
                                         HAS_ZP=False, HAS_BIAS=False, PDL=True, SW=512, SS=128, SZ=128, BLOCK_N=8,
                                         BLOCK_W=128, EVEN=True, AHEAD=True, HALF2=True, DW=2, WCACHE=".cg"),
                                    dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8"), ("ld.global.cg.b64",)),
        # the prefetches into L1 too (PF1) for MXFP4's scale rows (SPF) and next steps (L2D)
        "w4_gemv1_mxfp4_prefetch_l1": (w4g1._w4_gemv1_kernel,
                                       dict(CHAIN=False, NORM=False, HAS_RES=False, GATED=False, FMT=1, GROUP=32,
                                            HAS_ZP=False, HAS_BIAS=False, PDL=True, SW=512, SS=128, SZ=128, BLOCK_N=8,
                                            BLOCK_W=128, EVEN=True, AHEAD=True, HALF2=True, DW=2, L2D=1, SPF=True,
                                            PF1=True),
                                       dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8"),
                                       ("prefetch.global.L1", "griddepcontrol.wait")),
        # the scale and zero-point rows prefetched before the PDL wait (SPF), a gated int4 product
        "w4_gemv1_int4_scale_rows_first": (w4g1._w4_gemv1_kernel,
                                           dict(CHAIN=False, NORM=True, HAS_RES=True, GATED=True, FMT=0,
                                                GROUP=128, HAS_ZP=True, HAS_BIAS=False, PDL=True, SW=0, SS=0,
                                                SZ=0, BLOCK_N=8, BLOCK_W=128, EVEN=True, AHEAD=False, HALF2=True,
                                                DW=1, SPF=True),
                                           dict(w_ptr="*i32", z_ptr="*i8", eps="fp32"),
                                           ("prefetch.global.L2", "griddepcontrol.wait")),
        # the one-row ptpc FP8 product (word pairs, the next words ahead) with its weight loads
        # cached in L2 only (`fp8_gemv1.WORD_CACHE` ".cg")
        "fp8_gemv1_words_cg": (fp8g1._fp8_gemv1_kernel, dict(HAS_BIAS=False, DW=2, BLOCK_N=4, BLOCK_W=128,
                                                             AHEAD=True, PDL=True, WCACHE=".cg"),
                               dict(x_ptr="*i64", xs_ptr="*fp32", w_ptr="*i64", ws_ptr="*fp32", b_ptr="*fp32"),
                               ("ld.global.cg.b64", "cvt.rn.f16x2.e4m3x2", "griddepcontrol.wait")),
        # the same quantizing its bf16 row on load from partial amaxes (QX: `fp8_gemv1_pending_launch`)
        "fp8_gemv1_quantized_on_load": (fp8g1._fp8_gemv1_kernel,
                                        dict(HAS_BIAS=False, DW=2, BLOCK_N=4, BLOCK_W=256, AHEAD=True, PDL=True,
                                             QX=1, PARTS=32),
                                        dict(x_ptr="*i64", xs_ptr="*fp32", w_ptr="*i64", ws_ptr="*fp32",
                                             b_ptr="*fp32", pm_ptr="*fp32"),
                                        ("cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.f16x2.e4m3x2", "fma.rn.f32",
                                         "griddepcontrol.wait")),
        # MXFP4 pair words (`fp4_pairs`) with a word pair's products in one fp16 chain (CHAIN), and
        # int4's chain with zero points
        "w4_gemv1_pair_words_chain": (w4g1._w4_gemv1_kernel,
                                      dict(NORM=False, HAS_RES=False, GATED=False, FMT=2, GROUP=32, HAS_ZP=False,
                                           HAS_BIAS=False, PDL=True, SW=512, SS=128, SZ=128, BLOCK_N=8,
                                           BLOCK_W=128, EVEN=True, AHEAD=True, HALF2=True, DW=2, CHAIN=True),
                                      dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8"),
                                      ("fma.rn.f16x2", "ld.global.b64", "shl.b32")),
        "w4_gemv1_int4_chain": (w4g1._w4_gemv1_kernel,
                                dict(NORM=False, HAS_RES=False, GATED=False, FMT=0, GROUP=128, HAS_ZP=True,
                                     HAS_BIAS=False, PDL=True, SW=0, SS=0, SZ=0, BLOCK_N=16, BLOCK_W=128,
                                     EVEN=True, AHEAD=False, HALF2=True, DW=2, CHAIN=True),
                                dict(w_ptr="*i32", z_ptr="*i8"), ("fma.rn.f16x2", "ld.global.b64")),
        # the q/k/v norm GEMV (`w4_gemv1_fused`'s tile) on pair words, one word a load
        "w4_gemv1_pair_words_norm": (w4g1._w4_gemv1_kernel,
                                     dict(NORM=True, HAS_RES=True, GATED=False, FMT=2, GROUP=32, HAS_ZP=False,
                                          HAS_BIAS=False, PDL=True, SW=512, SS=128, SZ=128, BLOCK_N=8,
                                          BLOCK_W=128, EVEN=True, AHEAD=True, HALF2=True, DW=1, CHAIN=False),
                                     dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8", eps="fp32"),
                                     ("fma.rn.f16x2", "shl.b32")),
        # the norm prologue (with the residual) and the SiLU-gated [gate | up] epilogue
        "w4_gemv1_int4_norm_gated": (w4g1._w4_gemv1_kernel, dict(CHAIN=False, NORM=True, HAS_RES=True, GATED=True, FMT=0,
                                                                 GROUP=128, HAS_ZP=False, HAS_BIAS=False, PDL=True, SW=0, SS=0, SZ=0, DW=1,
                                                                 BLOCK_N=8, BLOCK_W=256, EVEN=True, AHEAD=True,
                                                                 HALF2=True),
                                     dict(w_ptr="*i32", eps="fp32"), ("fma.rn.f16x2", "ex2.approx")),
        # split decode attention merged by the last segment's program (`split_merge`): its count
        # (an acq_rel atomic at GPU scope) and the partials read past L1
        "attention_merge_in_kernel": (attn._unified_attn_kernel,
                                      dict(QPKV=4, NUM_KV_HEADS=8, HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16,
                                           BLOCK_M=16, BLOCK_Q=4, TILE_N=64, NUM_SPLITS=16, DOT_PREC="tf32", PDL=True,
                                           ROPE=True, QK_NORM=False, HAS_SINKS=False, SLIDING=False, KV_FP8=False,
                                           EXACT_ROUND=False, HAS_AMAX=True, MERGE_LAST=True, QPAD=4, S_CHUNK=16),
                                      dict(f32, **idx, po_ptr="*fp32", plse_ptr="*fp32", slot_ptr="*i64",
                                           cs_ptr="*fp32", norm_eps="fp32", amax_ptr="*fp32"),
                                      ("griddepcontrol.wait", "atom.global.gpu.acq_rel.add", "ld.global.cg")),
        # rows prepared by the kernel in front (`h2_xpack`): the GEMV's loop reading them (int4; MXFP4
        # word pairs with 1 / rms applied, PNORM), o_proj's epilogue preparing the next norm's input
        # (EPI), and the SiLU and norm kernels writing them
        "w4_gemv1_int4_prepared": (w4g1._w4_gemv1_kernel,
                                   dict(FMT=0, GROUP=128, HAS_ZP=True, HAS_BIAS=False, PDL=True, BLOCK_N=8,
                                        BLOCK_W=256, EVEN=True, AHEAD=True, HALF2=True, XPACK=True),
                                   dict(w_ptr="*i32", z_ptr="*i8", xk_ptr="*i32"), ("fma.rn.f16x2", "griddepcontrol.wait")),
        "w4_gemv1_mxfp4_prepared_norm": (w4g1._w4_gemv1_kernel,
                                         dict(FMT=1, GROUP=32, HAS_ZP=False, HAS_BIAS=False, PDL=True, SW=512, SS=128,
                                              SZ=128, BLOCK_N=8, BLOCK_W=64, EVEN=True, AHEAD=True, HALF2=True, DW=2,
                                              XPACK=True, PNORM=True),
                                         dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8", xk_ptr="*i32", eps="fp32"),
                                         ("fma.rn.f16x2", "sqrt")),
        "w4_gemv1_int4_epilogue": (w4g1._w4_gemv1_kernel,
                                   dict(FMT=0, GROUP=128, HAS_ZP=False, HAS_BIAS=False, PDL=True, BLOCK_N=8,
                                        BLOCK_W=256, EVEN=True, AHEAD=True, HALF2=True, EPI=True, EODD16=True),
                                   dict(w_ptr="*i32", ek_ptr="*i32"), ("fma.rn.f16x2", "cvt.rn.f16x2.f32")),
        # o_proj's epilogue writing h w and its sum of h^2, gate-up scaling by 1 / rms (EPI_ROW, RSQ)
        "w4_gemv1_int4_epilogue_row": (w4g1._w4_gemv1_kernel,
                                       dict(FMT=0, GROUP=128, HAS_ZP=False, HAS_BIAS=False, PDL=True, BLOCK_N=8,
                                            BLOCK_W=256, EVEN=True, AHEAD=True, HALF2=True, EPI_ROW=True),
                                       dict(w_ptr="*i32", esq_ptr="*fp32"), ("fma.rn.f16x2", "griddepcontrol.wait")),
        # the same with EARLY (`w4_gemv1.EARLY_EPILOGUE`) and SPF: the epilogue's lines asked of L2 ahead
        "w4_gemv1_int4_epilogue_row_early": (w4g1._w4_gemv1_kernel,
                                             dict(FMT=0, GROUP=128, HAS_ZP=False, HAS_BIAS=False, PDL=True,
                                                  BLOCK_N=8, BLOCK_W=256, EVEN=True, AHEAD=True, HALF2=True,
                                                  EPI_ROW=True, SPF=True, EARLY=True),
                                             dict(w_ptr="*i32", esq_ptr="*fp32"),
                                             ("prefetch.global.L2", "griddepcontrol.wait")),
        # "w4_l2_next": the q/k/v norm GEMV asks L2 for the next products' weights after its loop (L2N)
        "w4_gemv1_int4_norm_l2_next": (w4g1._w4_gemv1_kernel,
                                       dict(NORM=True, HAS_RES=True, GATED=False, FMT=0, GROUP=128, HAS_ZP=False,
                                            HAS_BIAS=False, PDL=True, BLOCK_N=8, BLOCK_W=128, EVEN=True, AHEAD=True,
                                            HALF2=True, SPF=True, L2N=2),
                                       dict(w_ptr="*i32", eps="fp32", l2a_ptr="*i32", l2b_ptr="*u8"),
                                       ("cp.async.bulk.prefetch.L2.global", "griddepcontrol.wait")),
        # `scripts/w4_mma_probe.py`: int4 groups on mma.sync, x in fragment order, loads carried a group ahead
        "w4_mma_probe": (mma._w4_mma_kernel, dict(WM=1, WK=8, D=1),
                         dict(f_ptr="*i32", sx_ptr="*fp32", us_ptr="*fp32", w_ptr="*i32", s_ptr="*bf16"),
                         ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",)),
        "w4_mma_probe_prep": (mma._prep_kernel, dict(BLOCK=4096), dict(us_ptr="*fp32", sx_ptr="*fp32", f_ptr="*i32"),
                              ("cvt.rn.f16x2.f32",)),
        "w4_gemv1_mxfp4_rsq": (w4g1._w4_gemv1_kernel,
                               dict(FMT=1, GROUP=32, HAS_ZP=False, HAS_BIAS=False, PDL=True, BLOCK_N=8, BLOCK_W=64,
                                    EVEN=True, AHEAD=True, HALF2=True, RSQ=True, RSQ_N=512),
                               dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8", rsq_ptr="*fp32", eps="fp32"),
                               ("fma.rn.f16x2", "sqrt")),
        "w4_gemv1_mxfp4_rsq_early": (w4g1._w4_gemv1_kernel,
                                     dict(FMT=1, GROUP=32, HAS_ZP=False, HAS_BIAS=False, PDL=True, BLOCK_N=8,
                                          BLOCK_W=64, EVEN=True, AHEAD=True, HALF2=True, RSQ=True, RSQ_N=512,
                                          EARLY=True),
                                     dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8", rsq_ptr="*fp32", eps="fp32"),
                                     ("fma.rn.f16x2", "sqrt")),
        "h2_silu_prepare": (h2x._silu_prepare_kernel, dict(ODD16=True, C=128, ASM=True, PDL=True),
                            dict(out_ptr="*i32"), ("griddepcontrol.wait", "cvt.rn.f16x2.f32")),
        "h2_norm_prepare": (h2x._norm_prepare_kernel, dict(ODD16=False, BLOCK=4096, HAS_RES=True, ASM=True, PDL=True),
                            dict(f32, out_ptr="*i32"), ("griddepcontrol.wait", "cvt.rn.f16x2.f32", "bar.sync")),
    }
    out, ptxs = {}, {}
    for name, (kernel, constexprs, types, *markers) in cases.items():
        constexprs = _with_defaults(kernel, constexprs)
        src = ASTSource(fn=kernel, signature=_signature(kernel, constexprs, types), constexprs=constexprs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        wanted = markers[0] if markers else ("griddepcontrol.wait", "griddepcontrol.launch_dependents")
        out[name] = {m: m in ptx for m in wanted}
        ptxs[name] = ptx
    # the decode attention prefetches its first K / V tile into L2 before it waits for the
    # kernel in front (PDL), and the merge reads the partials only after its wait
    p = ptxs["w4_gemv1_int4_scale_rows_first"]  # the scale rows before the wait, the loop's loads after
    out["w4_gemv1_scale_rows_before_wait"] = {
        "before the wait": 0 <= p.find("prefetch.global.L2") < p.find("griddepcontrol.wait")}
    # EARLY: the residual's line asked for after the wait, which the epilogue without it never does
    after_wait = {n: ptxs[n].split("griddepcontrol.wait")[1].count("prefetch.global.L2")
                  for n in ("w4_gemv1_int4_epilogue_row", "w4_gemv1_int4_epilogue_row_early")}
    out["w4_gemv1_early_epilogue_prefetch"] = {
        "the residual's line after the wait": after_wait["w4_gemv1_int4_epilogue_row_early"] > 0
        and after_wait["w4_gemv1_int4_epilogue_row"] == 0}
    # L2N: two bulk prefetches (o_proj's and gate-up's regions), after the PDL wait and after the
    # loop's last weight load
    p = ptxs["w4_gemv1_int4_norm_l2_next"]
    after_wait = p[p.rfind("griddepcontrol.wait"):]
    out["w4_gemv1_l2_next_after_the_loop"] = {
        "two after the wait": after_wait.count("cp.async.bulk.prefetch.L2.global") == 2,
        "after the last load": p.rfind("ld.global") < p.find("cp.async.bulk.prefetch.L2.global")}
    p = ptxs["attention_decode_split"]
    out["attention_prefetch_before_wait"] = {
        "prefetch.global.L2": "prefetch.global.L2" in p,
        "before the wait": 0 <= p.find("prefetch.global.L2") < p.find("griddepcontrol.wait")}
    # the attention's K / V tiles in flight (the depth of their shared-memory buffers, TTGIR) at
    # 3 stages: one with the block-table entries loaded in the tile's own iteration, two with
    # them loaded a tile ahead (`rows_ahead`)
    import re
    decode = _with_defaults(attn._unified_attn_kernel, dict(cases["attention_decode_split"][1], NUM_SPLITS=1))
    names = attn._unified_attn_kernel.arg_names  # pointers and row strides 16-aligned, as launched
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
               if a.endswith("_ptr") or (a.startswith("stride_") and a != "stride_plh")}
    for ahead in (False, True):
        src = ASTSource(fn=attn._unified_attn_kernel, signature=_signature(
            attn._unified_attn_kernel, dict(decode, ROWS_AHEAD=ahead), cases["attention_decode_split"][2]),
            constexprs=dict(decode, ROWS_AHEAD=ahead), attrs=aligned)
        ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_stages=3)).asm["ttgir"]
        depth = max(int(n) for n in re.findall(r"memdesc<(\d+)x128x64xbf16", ttgir))
        out[f"attention_3_stages_rows_ahead_{ahead}"] = {f"{1 + ahead} K tiles in flight": depth == 1 + ahead}
    # bf16 queries over an FP8 cache (KV_F16): e4m3 pairs straight to fp16 pairs, no per-value
    # fp16 -> bf16 conversion
    fp8 = dict(cases["attention_decode_split"][2], k_ptr="*fp8e4nv", v_ptr="*fp8e4nv", ks_ptr="*fp32",
               vs_ptr="*fp32")
    cx = dict(decode, KV_FP8=True, KV_F16=True)
    src = ASTSource(fn=attn._unified_attn_kernel, signature=_signature(attn._unified_attn_kernel, cx, fp8),
                    constexprs=cx, attrs=aligned)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    out["attention_fp8_f16_dots"] = {"cvt.rn.f16x2.e4m3x2": "cvt.rn.f16x2.e4m3x2" in ptx,
                                     "no cvt.bf16.f16": "cvt.bf16.f16" not in ptx}
    # the one-row FP8 product's scales and bias loaded before the PDL wait (`fp8_gemv1.SCALES_FIRST`):
    # more global loads ahead of `griddepcontrol.wait` than the default's (its first weight tile)
    loads_first = {}
    for first in (False, True):
        cx = _with_defaults(fp8g1._fp8_gemv1_kernel, dict(HAS_BIAS=True, DW=2, BLOCK_N=4, BLOCK_W=128, AHEAD=True,
                                                          PDL=True, SFIRST=first))
        types = dict(x_ptr="*i64", xs_ptr="*fp32", w_ptr="*i64", ws_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16")
        src = ASTSource(fn=fp8g1._fp8_gemv1_kernel, signature=_signature(fp8g1._fp8_gemv1_kernel, cx, types),
                        constexprs=cx)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
        loads_first[first] = ptx.split("griddepcontrol.wait")[0].count("ld.global")
    out["fp8_gemv1_scales_first"] = {"scale and bias loads before the wait": loads_first[True] > loads_first[False]}
    return out


def test_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no ptxas for NVIDIA targets")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-W", "ignore", os.path.abspath(__file__)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got) == {"gemv_fused_gated", "gemv_plain_ahead", "gemv_norm_rope", "rope_kv_write",
                        "attention_decode_split", "attention_fp8_window_sinks", "kv_write_fp8",
                        "add_rmsnorm", "silu_and_mul", "merge", "gemm_tma",
                        "sampling_block_stats", "sampling_pick", "moe_gemm_sorted", "moe_gemm_gated",
                        "moe_gemv_unsorted", "attention_3_stages_rows_ahead_False",
                        "attention_3_stages_rows_ahead_True", "attention_fp8_f16_dots", "w4_gemv1_int4_masked",
                        "w4_gemv1_mxfp4_masked", "w4_gemv1_int4_ahead", "w4_gemv1_int4_half2",
                        "w4_gemv1_mxfp4_half2", "w4_gemv1_int4_norm_gated", "w4_gemv1_mxfp4_fixed_strides",
                        "w4_gemv1_int4_scale_strides",
                        "w4_gemv1_mxfp4_pairs", "w4_gemv1_pair_words_chain", "w4_gemv1_int4_chain",
                        "w4_gemv1_pair_words_norm", "w4_gemv1_int4_l2_prefetch", "w4_gemv1_mxfp4_stages",
                        "w4_gemv1_mxfp4_words_cg", "w4_gemv1_int4_scale_rows_first", "w4_gemv1_mxfp4_prefetch_l1",
                        "w4_gemv1_scale_rows_before_wait", "fp8_gemv1_words_cg", "fp8_gemv1_scales_first",
                        "fp8_gemv1_quantized_on_load",
                        "attention_prefetch_before_wait", "merge_amax",
                        "attention_one_pass_amax", "attention_qkv_sum", "attention_merge_in_kernel",
                        "w4_gemv1_int4_prepared", "w4_gemv1_mxfp4_prepared_norm", "w4_gemv1_int4_epilogue",
                        "w4_gemv1_int4_epilogue_row", "w4_gemv1_mxfp4_rsq", "h2_silu_prepare", "h2_norm_prepare",
                        "w4_gemv1_int4_epilogue_row_early", "w4_gemv1_mxfp4_rsq_early",
                        "w4_gemv1_early_epilogue_prefetch", "w4_gemv1_int4_norm_l2_next",
                        "w4_gemv1_l2_next_after_the_loop", "w4_mma_probe", "w4_mma_probe_prep"}
    for name, flags in got.items():
        # each PDL kernel waits for the one in front and lets the next in; the GEMM uses TMA + wgmma;
        # the sampler's kernels build; the sorted MoE GEMM uses mma
        assert all(flags.values()), (name, flags)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
