# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# int4's deep tile (Llama's down, 4096 x 14336) as 8 rows over 4 warps, word pairs in one fp16 chain
# (DW = 2, CHAIN) with the next pair loaded a step ahead: sm90 (Triton 3.6) 2.63 loop instructions a
# weight against 3.45, 91 registers, 5 programs an SM, 512 programs in 0.78 waves, 7 steps; each
# thread has 8 rows x 8 bytes x 2 steps in flight (the table's 8 x 4 x 2 over twice the warps).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES_DEEP["int4"] = dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True, HALF2=True, DW=2, CHAIN=True,
                          SPF=True)
PY
