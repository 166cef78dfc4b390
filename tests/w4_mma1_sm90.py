"""Compiles `w4_mma1._w4_mma1_kernel` for sm90 (no GPU needed) at the table's tiles and a few
others, and prints, as one JSON line, what each compiled to: the tensor-core instruction, the
dequantizing instructions, and whether the loop goes through shared memory (it should not:
the operands are built in registers, `convert_layout(..., assert_trivial=True)` would fail the
compile otherwise). Run by tests/test_w4_mma1.py in a child process (no interpreter)."""
from __future__ import annotations

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from atom.model_ops.kernels import w4_mma1


def compile_one(cfg: dict) -> dict:
    k = w4_mma1._w4_mma1_kernel
    cx = dict(ROWS=cfg["ROWS"], NW=cfg["NW"], REP=cfg.get("REP", 1), AHEAD=cfg["AHEAD"], GROUP=128,
              HAS_BIAS=True, PDL=True)
    types = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16"}
    names = k.arg_names
    sig = {a: "constexpr" if a in cx else types.get(a, "i32") for a in names}
    div = {"x_ptr", "w_ptr", "s_ptr", "b_ptr", "y_ptr", "stride_wn", "stride_sn", "n_words"}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a in div}
    src = GluonASTSource(fn=k, signature=sig, constexprs=cx, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg["NW"])).asm["ptx"]
    body = ptx.split("$L__BB0_2:")[1].split("$L__BB0_3:")[0] if "$L__BB0_2:" in ptx else ""
    return dict(mma=len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)),
                lop3=ptx.count("lop3.b32"), sub=ptx.count("sub.rn.bf16x2"), pdl=ptx.count("griddepcontrol.wait"),
                loop_shared=body.count("ld.shared") + body.count("st.shared"), loop=bool(body))


def main() -> None:
    cfgs = {f"{k}": v for k, v in w4_mma1.TILES.items()}
    cfgs["rows32_rep2"] = dict(ROWS=32, NW=4, REP=2, AHEAD=True)
    print(json.dumps({name: dict(compile_one(cfg), cfg={k: cfg[k] for k in ("ROWS", "NW", "AHEAD")}
                                 | {"REP": cfg.get("REP", 1)})
                      for name, cfg in cfgs.items()}))


if __name__ == "__main__":
    main()
