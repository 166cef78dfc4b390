# Variant: MXFP4's one-row GEMV tiles (all three tables, pair words' too) with their registers
# capped at 64 (Triton's maxnreg, a launch option); the tables' default since 90bd662 (a no-op there).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _fmt in ("mxfp4", "mxfp4_pairs"):
        _table[_fmt].update(maxnreg=64)
PY
