# Variant: MXFP4's one-row GEMV tiles without their register cap (maxnreg, the tables' default since
# 90bd662): ptxas's own register count (60-62).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _fmt in ("mxfp4", "mxfp4_pairs"):
        _table[_fmt].pop("maxnreg", None)
PY
