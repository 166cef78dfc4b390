# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/int4):
# int4's one-row GEMV tiles (plain, wide, deep) with two words a load and CHAIN (a word pair's fp16
# products in one chain), the deep tile over 4 warps as MXFP4's so that 14,336 columns pair up;
# the fused norm GEMV's tiles as they are.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES_DEEP["int4"] = dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True, HALF2=True)
for _table in (TILES, TILES_WIDE, TILES_DEEP):
    _table["int4"].update(DW=2, CHAIN=True)
PY
