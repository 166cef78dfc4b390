# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# int4's deep tile (Llama's down, 4096 x 14336) as 16 rows over 4 warps, word pairs in one fp16 chain
# (DW = 2, CHAIN) with the next pair loaded a step ahead: sm90 (Triton 3.6) 2.15 loop instructions a
# weight against 3.45, 94 registers, 5 programs an SM, 256 programs in 0.39 waves (~8 warps an SM),
# 7 steps; each thread has 16 rows x 8 bytes x 2 steps in flight.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES_DEEP["int4"] = dict(BLOCK_N=16, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True, HALF2=True, DW=2,
                          CHAIN=True, SPF=True)
PY
