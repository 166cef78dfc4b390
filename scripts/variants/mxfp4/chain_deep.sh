# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/mxfp4):
# CHAIN (a word pair's fp16 products in one chain) in MXFP4's deep tile only (Llama's down
# product); `chain_mx` puts it in every MXFP4 tile.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _fmt in ("mxfp4", "mxfp4_pairs"):
    TILES_DEEP[_fmt].update(CHAIN=True)
PY
