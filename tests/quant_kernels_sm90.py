"""Builds the 8-bit linear kernels (`kernels.act_quant`, `kernels.quant_gemm`) for an NVIDIA
sm90 target without a GPU and reports marks of their PTX, as one JSON line (run as a child
process by tests/test_quant_kernels_fp8.py, without TRITON_INTERPRET):
the activation quantizer's correctly rounded divisions and e4m3 conversion, PDL's
griddepcontrol in the quantizer and the GEMV, the GEMV's
16-byte weight loads (with the 16-divisible strides and pointers the launcher specializes on
at run time), the GEMMs' tensor-core instructions (mma at 16 rows, wgmma at 64+).

    python tests/quant_kernels_sm90.py
"""
from __future__ import annotations

import json


def _launch_tiles(cfg: dict) -> dict:
    """A tile table's entry without the launch options (warps, stages), as kernel constexprs."""
    return {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}


def compile_all() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom.model_ops.kernels import act_quant as aq
    from atom.model_ops.kernels import quant_gemm as qg

    def ops(x, w, y="*bf16", b="*bf16"):
        return dict(xq_ptr=x, w_ptr=w, xs_ptr="*fp32", ws_ptr="*fp32", b_ptr=b, y_ptr=y)

    f8, i8 = "*fp8e4nv", "*i8"
    PROMOTE = "ttgir:maxNumImpreciseAcc = 128"  # fp8 sums carried into fp32 every 128 of K (triton_import)
    gemm = dict(GROUP_M=8, HAS_BIAS=False, IMPRECISE=0)
    cases = {
        "act_quant_fp8": (aq._act_quant_kernel, dict(STATIC=False, INT8=False, BLOCK=4096, SINGLE=True, PDL=True),
                          dict(x_ptr="*bf16", q_ptr=f8, s_ptr="*fp32", static_ptr="*fp32", qmax="fp32"),
                          ("div.rn.f32", "e4m3x2", "griddepcontrol.wait", "griddepcontrol.launch_dependents")),
        "act_quant_fp8_chunks": (aq._act_quant_kernel, dict(STATIC=False, INT8=False, BLOCK=4096, SINGLE=False,
                                                            PDL=False),
                                 dict(x_ptr="*bf16", q_ptr=f8, s_ptr="*fp32", static_ptr="*fp32", qmax="fp32"),
                                 ("div.rn.f32", "e4m3x2")),
        "act_quant_int8": (aq._act_quant_kernel, dict(STATIC=True, INT8=True, BLOCK=128, SINGLE=True, PDL=True),
                           dict(x_ptr="*fp16", q_ptr=i8, s_ptr="*fp32", static_ptr="*fp32", qmax="fp32"),
                           ("div.rn.f32", "griddepcontrol.wait")),
        "gemv_fp8": (qg._qgemv_kernel, dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, BLOCKS=False, HAS_BIAS=True,
                                            PDL=True, AHEAD=True),
                     ops(f8, f8), ("ld.global.v4.b32", "e4m3x2", "griddepcontrol.wait")),
        "gemv_fp8_block": (qg._qgemv_kernel, dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=128, BLOCKS=True, HAS_BIAS=False,
                                                  PDL=True, AHEAD=False),
                           ops(f8, f8), ("ld.global.v4.b32", "e4m3x2")),
        "gemv_int8": (qg._qgemv_kernel, dict(BLOCK_M=4, BLOCK_N=2, BLOCK_K=512, BLOCKS=False, HAS_BIAS=False,
                                             PDL=False, AHEAD=False),
                      ops(i8, i8, "*fp16", "*fp16"), ("ld.global.v4.b32",)),
        "gemm_fp8_m16": (qg._qgemm_kernel, dict(gemm, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, BLOCKS=False, INT=False),
                         ops(f8, f8, "*fp16", "*fp16"), ("mma", PROMOTE)),
        "gemm_fp8": (qg._qgemm_kernel, dict(gemm, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, BLOCKS=False, INT=False),
                     ops(f8, f8), ("wgmma", PROMOTE)),
        "gemm_fp8_block": (qg._qgemm_kernel, dict(gemm, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, BLOCKS=True, INT=False),
                           ops(f8, f8), ("wgmma",)),
        "gemm_int8": (qg._qgemm_kernel, dict(gemm, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, BLOCKS=False, INT=True),
                      ops(i8, i8), ("wgmma",)),
        # the shipped defaults of the decode GEMV and of the M <= 16 block GEMM
        "gemv_fp8_default": (qg._qgemv_kernel, dict(_launch_tiles(qg.gemv_config(1)), BLOCKS=False, HAS_BIAS=False,
                                                    PDL=True),
                             ops(f8, f8), ("ld.global.v4.b32", "e4m3x2", "griddepcontrol.wait")),
        "gemm_fp8_block_m16_default": (qg._qgemm_kernel, dict(gemm, **_launch_tiles(qg.gemm_config(8, 4096, 128)),
                                                              BLOCKS=True, INT=False),
                                       ops(f8, f8), ("mma",)),
        "gemm_int8_m16": (qg._qgemm_kernel, dict(gemm, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, BLOCKS=False, INT=True),
                          ops(i8, i8), ("mma",)),
    }
    divisible = {"x_ptr", "q_ptr", "xq_ptr", "w_ptr", "y_ptr", "K", "stride_xm", "stride_qm", "stride_wn",
                 "stride_ym", "group"}
    out = {}
    for name, (kernel, constexprs, types, marks) in cases.items():
        names = kernel.arg_names
        sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in names}
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a in divisible}
        src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
        asm = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm
        out[name] = {m: m[6:] in asm["ttgir"] if m.startswith("ttgir:") else m in asm["ptx"] for m in marks}
    return out


if __name__ == "__main__":
    print(json.dumps(compile_all()))
