# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/mxfp4,
# VAR_FORMATS mxfp4_w4a16 and / or w4a16: the fused tile is one table for both formats): the q/k/v GEMV with
# the norm inside (`fused_tiles(False)`) with room for 128 registers (Triton's maxnreg): compiled for
# sm90, MXFP4 pair words take 100 registers and 5.92 loop instructions a weight against 75 and 6.14
# with no cap, at 5 programs an SM instead of 6.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

FUSED_TILES[False].update(maxnreg=128)
PY
grep -q 'FUSED_TILES\[False\].update(maxnreg=128)' atom/model_ops/kernels/w4_gemv1.py
