"""Builds the fused quantizers (`kernels.act_quant_fused`: add + RMSNorm + quantize, SiLU-and-mul
+ quantize) for an NVIDIA sm90 target without a GPU and reports marks of their PTX, as one
JSON line (run as a child process by tests/test_act_quant_fused.py, without
TRITON_INTERPRET): the quantizer's correctly rounded division, the e4m3 conversion, PDL's
griddepcontrol.

    python tests/act_quant_fused_sm90.py
"""
from __future__ import annotations

import json


def compile_all() -> dict:
    import triton

    from atom.model_ops.kernels import act_quant_fused as aqf
    from atom.model_ops.kernels.rmsnorm import norm_row_config

    f8, i8 = "*fp8e4nv", "*i8"
    norm = norm_row_config(4096)
    silu = aqf.silu_quant_config(14336)
    marks = ("div.rn.f32", "griddepcontrol.wait")

    def norm_types(x, q):
        return dict(x_ptr=x, r_ptr=x, w_ptr=x, rout_ptr=x, q_ptr=q, s_ptr="*fp32", eps="fp32", qmax="fp32")

    def silu_types(x, q):
        return dict(x_ptr=x, q_ptr=q, s_ptr="*fp32", qmax="fp32")

    cases = {
        "norm_quant_fp8": (aqf._norm_quant_kernel, dict(BLOCK=norm["BLOCK"], HAS_RES=True, INT8=False, PDL=True,
                                                        SUM=False, HAS_BIAS=False, b_ptr=None),
                           norm_types("*bf16", f8), norm["num_warps"], marks + ("e4m3x2",)),
        "norm_quant_int8": (aqf._norm_quant_kernel, dict(BLOCK=norm["BLOCK"], HAS_RES=False, INT8=True, PDL=True,
                                                         SUM=False, HAS_BIAS=False, b_ptr=None),
                            norm_types("*fp16", i8), norm["num_warps"], marks),
        # o_proj's split-K partials summed in front of the norm ("sum+norm+quant")
        "norm_quant_sum_fp8": (aqf._norm_quant_kernel, dict(BLOCK=norm["BLOCK"], HAS_RES=True, INT8=False, PDL=True,
                                                            SUM=True, HAS_BIAS=True, ACT=triton.language.bfloat16),
                               dict(norm_types("*bf16", f8), x_ptr="*fp32", b_ptr="*bf16"), norm["num_warps"],
                               marks + ("e4m3x2",)),
        "silu_quant_fp8": (aqf._silu_quant_kernel, dict(BLOCK=silu["BLOCK"], SINGLE=True, INT8=False, PDL=True),
                           silu_types("*bf16", f8), silu["num_warps"], marks + ("e4m3x2",)),
        "silu_quant_fp8_chunks": (aqf._silu_quant_kernel, dict(BLOCK=4096, SINGLE=False, INT8=False, PDL=True),
                                  silu_types("*bf16", f8), 8, marks + ("e4m3x2",)),
        "silu_quant_int8": (aqf._silu_quant_kernel, dict(BLOCK=silu["BLOCK"], SINGLE=True, INT8=True, PDL=True),
                            silu_types("*bf16", i8), silu["num_warps"], marks),
    }
    out = {}
    for name, (kernel, constexprs, types, warps, want) in cases.items():
        ptx = _compile(kernel, constexprs, types, warps)["ptx"]
        out[name] = {m: m in ptx for m in want}
    out.update(same_norm_layouts(norm))
    return out


def _compile(kernel, constexprs: dict, types: dict, warps: int, aligned: bool = False) -> dict:
    """`kernel` compiled for sm90 (its asm by stage); the arguments not in `types` are i32.
    `aligned`: pointers, strides and N divisible by 16, as a launch on aligned tensors of 4096
    columns specializes them (which decides how many columns a thread holds)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(kernel.arg_names)
    sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if aligned and (t.startswith("*") or a.startswith("stride") or a == "N")}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm


def _layouts(kernel, constexprs: dict, types: dict, warps: int) -> set:
    """The columns a thread holds in `kernel`'s blocked layouts, compiled as a launch on
    aligned tensors specializes it."""
    import re
    ttgir = _compile(kernel, constexprs, types, warps, aligned=True)["ttgir"]
    return set(re.findall(r"sizePerThread = \[(\d+)\]", ttgir))


def same_norm_layouts(norm: dict) -> dict:
    """Whether the norm-quantizer lays a row out as the norm kernel does (the same columns a
    thread, so the same order of the sum of squares, so the same bits), for bf16 / fp16 /
    fp32 activations and for the pending split-K sum ("sum+norm+quant", bf16)."""
    import triton

    from atom.model_ops.kernels import act_quant_fused as aqf
    from atom.model_ops.kernels import rmsnorm
    out = {}
    for act, q in (("bf16", "*fp8e4nv"), ("fp16", "*i8"), ("fp32", "*fp8e4nv")):
        ptr = "*" + act
        norm_k = _layouts(rmsnorm._rmsnorm_kernel, dict(BLOCK=norm["BLOCK"], HAS_RES=True, PDL=True),
                          dict(x_ptr=ptr, r_ptr=ptr, w_ptr=ptr, out_ptr=ptr, rout_ptr=ptr, eps="fp32"), norm["num_warps"])
        types = dict(x_ptr=ptr, r_ptr=ptr, w_ptr=ptr, rout_ptr=ptr, q_ptr=q, s_ptr="*fp32", eps="fp32", qmax="fp32")
        fused = _layouts(aqf._norm_quant_kernel, dict(BLOCK=norm["BLOCK"], HAS_RES=True, INT8=q == "*i8", PDL=True,
                                                      SUM=False, HAS_BIAS=False, b_ptr=None), types, norm["num_warps"])
        out[f"norm_layout_{act}"] = {"one layout": len(norm_k) == 1, "the norm kernel's": fused == norm_k}
        if act == "bf16":
            summed = _layouts(aqf._norm_quant_kernel, dict(BLOCK=norm["BLOCK"], HAS_RES=True, INT8=False, PDL=True,
                                                           SUM=True, HAS_BIAS=True, ACT=triton.language.bfloat16),
                              dict(types, x_ptr="*fp32", b_ptr="*bf16"), norm["num_warps"])
            out["norm_layout_sum_bf16"] = {"the norm kernel's": summed == norm_k}
    return out


if __name__ == "__main__":
    print(json.dumps(compile_all()))
