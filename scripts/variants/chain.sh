# Variant: CHAIN (a word pair's fp16 products in one chain) in the one-row GEMV's tables: MXFP4's
# tiles (already two words a load) and int4's plain, wide and deep tiles with two words a load
# (int4's deep tile over 4 warps, as MXFP4's, so that 14,336 columns pair up); the fused norm
# GEMV's tiles as they are.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES_DEEP["int4"] = dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True, HALF2=True)
for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _fmt in _table:
        _table[_fmt].update(DW=2, CHAIN=True)
PY
