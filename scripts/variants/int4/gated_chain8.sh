# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# int4's gated one-row product (gate-up with SiLU inside, "w4_gate_up_silu") at 8 gate + 8 up rows
# over 2 warps, word pairs in one fp16 chain (DW = 2, CHAIN), no words ahead: sm90 2.02 instructions
# a weight against 2.59 (517 a step of 256 weights against 332 of 128), 68 registers, 14 programs
# an SM, Llama's 1,792 programs in 0.97 waves against 1.70. CHAIN rounds otherwise (one fp16 chain
# for 16 columns), within the reference's tolerance.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

_table_gated_tiles = gated_tiles


def gated_tiles(rows: int, fmt: str = "int4", k: int = 0) -> dict:
    if fmt == "int4" and rows > WIDE_N:
        return dict(BLOCK_N=8, BLOCK_W=64, num_warps=2, num_stages=3, HALF2=True, DW=2, CHAIN=True, SPF=True)
    return _table_gated_tiles(rows, fmt, k)
PY
