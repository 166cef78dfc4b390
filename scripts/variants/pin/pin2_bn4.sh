# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/pin):
# the one-row 4-bit GEMV's tiles of mxfp4 and mxfp4_pairs with PIN=2 (`w4_gemv1`: the warp barrier that keeps
# the loads at the top of the step) and 4 rows a program, so that the words loaded ahead fit MXFP4's
# register cap (maxnreg 64) without spills.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'
for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _fmt in ("mxfp4", "mxfp4_pairs"):
        _table[_fmt]["PIN"] = 2
        _table[_fmt]["BLOCK_N"] = 4
PY
grep -q '_table\[_fmt\]\["BLOCK_N"\] = 4' atom/model_ops/kernels/w4_gemv1.py
