# Variant: only int4's wide tile (more than 8192 outputs: Llama's gate-up, 16 rows over 4 warps)
# with two words a load and CHAIN.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES_WIDE["int4"].update(DW=2, CHAIN=True)
PY
