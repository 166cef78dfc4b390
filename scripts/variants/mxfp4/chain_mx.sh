# Variant: CHAIN (a word pair's fp16 products in one chain) in MXFP4's one-row GEMV tiles (two
# words a load already), pair words' too; int4's and the fused norm GEMV's tiles as they are.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _fmt in ("mxfp4", "mxfp4_pairs"):
        _table[_fmt].update(CHAIN=True)
PY
