# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/mxfp4,
# VAR_FORMATS mxfp4_w4a16 and / or w4a16: the fused tile is one table for both formats): the q/k/v GEMV with
# the norm inside (`fused_tiles(False)`) reading word pairs (DW = 2) as MXFP4's other tiles do.
# Compiled for sm90 (`w4_gemv_sass.py`'s compile_gemv1 with that tile, NORM): 125 registers, 5.39
# loop instructions a weight against 6.14 at one word a load (75 registers), the words issued
# 282-289 instructions ahead of their use against 120-127; 4 programs an SM instead of 6, so
# q/k/v's 768 programs take ~1.5 waves instead of one.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

FUSED_TILES[False].update(DW=2)
PY
grep -q 'FUSED_TILES\[False\].update(DW=2)' atom/model_ops/kernels/w4_gemv1.py
