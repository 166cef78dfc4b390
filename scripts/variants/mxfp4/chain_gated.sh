# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/mxfp4):
# CHAIN (a word pair's fp16 products in one chain) in MXFP4's gated gate-up tile only (the wide
# tile's geometry, 4 + 4 rows, words ahead, registers capped at 64); `chain_mx` puts it in every
# MXFP4 tile.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

GATED_TILES["mxfp4_pairs"] = dict(TILES_WIDE["mxfp4_pairs"], BLOCK_N=TILES_WIDE["mxfp4_pairs"]["BLOCK_N"] // 2,
                                  CHAIN=True)
GATED_TILES["mxfp4"] = dict(GATED_TILES["mxfp4_pairs"])
PY
