"""Builds the swap-AB small-M kernel (`kernels.quant_gemv_dot`) for an NVIDIA sm90 target
without a GPU and reports marks of its PTX, as one JSON line (run as a child process by
tests/test_quant_gemv_dot.py, without TRITON_INTERPRET): tensor-core instructions (wgmma
at 64+ weight rows a program, mma below), asynchronous copies (the pipelined weight loads),
PDL's griddepcontrol, the e4m3 conversion of the fused quantizer (also on load, with the
scale from partial amaxes), its correctly rounded division, the folded split K's barrier,
GPU-scope acq_rel counter and L2 reads; weight tiles through TMA (bulk tensor copies, the
first one issued before the PDL wait with EARLY); and the split reduction; and that fp8 sums
are carried into fp32 every 128 of K.

    python tests/quant_gemv_dot_sm90.py
"""
from __future__ import annotations

import json


def compile_all() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom.model_ops.kernels import quant_gemv_dot as qd

    f8, i8 = "*fp8e4nv", "*i8"

    def ops(x, w, y="*bf16"):
        return dict(x_ptr=x, w_ptr=w, xs_ptr="*fp32", ws_ptr="*fp32", b_ptr=y, y_ptr=y, p_ptr="*fp32",
                    lock_ptr="*i32", qmax="fp32")

    base = dict(M_PAD=16, BLOCK_N=64, BLOCK_K=256, SPLIT=True, BLOCKS=False, INT=False, HAS_BIAS=False,
                QUANT_X=False, STATIC=False, PARTS=0, X1=False, FOLD=False, PDL=True, TMA=False, EARLY=False)
    # the folded split K: a block barrier, one thread's acq_rel counter at GPU scope, L2 reads
    fold = ("bar.sync", "atom.global.gpu.acq_rel.add", "ld.global.cg", "atom.global.gpu.acq_rel.exch")
    mark = ("wgmma", "cp.async", "griddepcontrol.wait")
    promote = ("ttgir:maxNumImpreciseAcc = 128",)  # fp8 sums carried into fp32 every 128 of K (triton_import)
    cases = {
        "fp8": (dict(base, HAS_BIAS=True), ops(f8, f8), mark + promote),
        "fp8_bn32": (dict(base, BLOCK_N=32, SPLIT=False), ops(f8, f8), ("mma.sync", "cp.async")),
        "fp8_m64": (dict(base, M_PAD=64, BLOCK_N=128, BLOCK_K=128), ops(f8, f8), mark + promote),
        "fp8_m128": (dict(base, M_PAD=128, BLOCK_N=64, BLOCK_K=128), ops(f8, f8), mark + promote),  # 65-128 rows
        "fp8_fused": (dict(base, QUANT_X=True), ops("*bf16", f8), mark + ("div.rn.f32", "e4m3x2")),
        "fp8_static": (dict(base, QUANT_X=True, STATIC=True), ops("*bf16", f8), mark + ("e4m3x2",)),
        "fp8_block": (dict(base, BLOCK_K=128, BLOCKS=True), ops(f8, f8), mark),
        "fp8_block_fused": (dict(base, BLOCK_K=128, BLOCKS=True, QUANT_X=True), ops("*bf16", f8),
                            mark + ("div.rn.f32", "e4m3x2")),
        "int8": (dict(base, INT=True), ops(i8, i8), mark + (".s8",)),
        "fp8_fold": (dict(base, HAS_BIAS=True, FOLD=True), ops(f8, f8), mark + fold + promote),
        "int8_fold": (dict(base, INT=True, FOLD=True), ops(i8, i8), mark + fold),
        "int8_fused": (dict(base, M_PAD=32, INT=True, QUANT_X=True), ops("*fp16", i8, "*fp16"),
                       mark + ("div.rn.f32",)),
        # rows quantized on load with the scale from partial amaxes (pending_quant): one row / several
        "fp8_pending1": (dict(base, QUANT_X=True, PARTS=16, X1=True), ops("*bf16", f8), mark + ("div.rn.f32", "e4m3x2")),
        "fp8_pending": (dict(base, QUANT_X=True, PARTS=16), ops("*bf16", f8), mark + ("div.rn.f32", "e4m3x2")),
        "int8_pending1": (dict(base, INT=True, QUANT_X=True, PARTS=16, X1=True), ops("*bf16", i8),
                          mark + ("div.rn.f32", ".s8")),
        # weight tiles through TMA (a tensor descriptor argument): bulk tensor copies, no cp.async for them
        "fp8_tma": (dict(base, HAS_BIAS=True, TMA=True), ops(f8, "tensordesc<fp8e4nv[64, 256]>"),
                    ("wgmma", "cp.async.bulk.tensor", "griddepcontrol.wait") + promote),
        "int8_tma": (dict(base, INT=True, TMA=True), ops(i8, "tensordesc<i8[64, 256]>"),
                     ("wgmma", "cp.async.bulk.tensor", ".s8")),
    }
    divisible = {"x_ptr", "w_ptr", "y_ptr", "p_ptr", "K", "stride_xm", "stride_wn", "stride_ym"}

    def build(constexprs: dict, types: dict) -> dict:
        names = qd._qdot_kernel.arg_names
        sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in names}
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a in divisible}
        src = ASTSource(fn=qd._qdot_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=4)).asm

    out = {}
    for name, (constexprs, types, marks) in cases.items():
        asm = build(constexprs, types)
        out[name] = {m: m[6:] in asm["ttgir"] if m.startswith("ttgir:") else m in asm["ptx"] for m in marks}
    # EARLY: the first weight tile's bulk copy is issued before the PDL wait
    ptx = build(dict(base, TMA=True, EARLY=True), ops(f8, "tensordesc<fp8e4nv[64, 256]>"))["ptx"]
    first_copy, wait = ptx.find("cp.async.bulk.tensor"), ptx.find("griddepcontrol.wait")
    out["fp8_tma_early"] = {"copy before the wait": 0 <= first_copy < wait, "wait": wait >= 0}
    from atom.model_ops.kernels import split_k
    kernel = split_k._split_k_sum_kernel
    constexprs = dict(BLOCK=1024, HAS_BIAS=True, PDL=True)
    sig = {a: "constexpr" if a in constexprs else {"p_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"}.get(a, "i32")
           for a in kernel.arg_names}
    ptx = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                         target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    out["split_reduce"] = {m: m in ptx for m in ("griddepcontrol.wait", "ld.global")}
    return out


if __name__ == "__main__":
    print(json.dumps(compile_all()))
