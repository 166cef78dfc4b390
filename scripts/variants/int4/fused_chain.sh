# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4;
# the tile is both formats', so time it in W4A16 only): the q/k/v GEMV with the norm inside
# (`FUSED_TILES[False]`) on the pattern of the gated tile: word pairs in one fp16 chain (DW = 2,
# CHAIN), no words ahead. sm90 int4 3.05 loop instructions a weight against 4.12, 92 registers, 5
# programs an SM (Llama's 768 programs in 1.16 waves against 0.97).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

FUSED_TILES[False] = dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, HALF2=True, DW=2, CHAIN=True, SPF=True)
PY
