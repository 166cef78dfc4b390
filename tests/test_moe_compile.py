"""The experts' Triton kernels build for an NVIDIA sm90 target on any machine.

The interpreter runs their logic in the other tests but never compiles them (an early
return, int64 pointer arithmetic or a dot shape the compiler refuses would pass there), so
this builds both kernels ahead of time for sm90 in a child process without TRITON_INTERPRET
and checks the sorted kernel's products run on tensor cores (mma).

    python tests/test_moe_compile.py    # the child: prints one JSON line
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _compile() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom.model_ops.moe import experts_triton as k

    def sig(kernel, constexprs, types):
        return {a: "constexpr" if a in constexprs else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                for a in kernel.arg_names}

    cases = {
        "moe_gemm_sorted": (k._moe_gemm_kernel,
                            dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, HAS_BIAS=True, MUL_WEIGHT=True,
                                 DOT_PREC="tf32"),
                            dict(sorted_ptr="*i32", block_expert_ptr="*i32", rw_ptr="*fp32"), "mma"),
        "moe_gemv_unsorted": (k._moe_gemv_kernel, dict(BLOCK_N=64, BLOCK_K=128, HAS_BIAS=False, MUL_WEIGHT=True),
                              dict(ids_ptr="*i64", rw_ptr="*fp32"), "ld.global"),
    }
    out = {}
    for name, (kernel, constexprs, types, marker) in cases.items():
        src = ASTSource(fn=kernel, signature=sig(kernel, constexprs, types), constexprs=constexprs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        out[name] = marker in ptx
    return out


def test_moe_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no ptxas for NVIDIA targets")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-W", "ignore", os.path.abspath(__file__)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"moe_gemm_sorted": True, "moe_gemv_unsorted": True}


if __name__ == "__main__":
    print(json.dumps(_compile()))
