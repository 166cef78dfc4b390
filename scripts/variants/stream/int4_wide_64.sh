# Variant: int4's wide tile (more than 8192 outputs: Llama's gate-up, 16 rows over 4 warps) with
# its registers capped at 64 (Triton's maxnreg; 71 uncapped, no spill at 64 with Triton 3.6):
# 8 programs an SM instead of 7.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES_WIDE["int4"].update(maxnreg=64)
PY
