# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/pin):
# the one-row 4-bit GEMV's tiles of mxfp4 and mxfp4_pairs with PIN=2 (`w4_gemv1`: the warp barrier that keeps
# the loads at the top of the step), without MXFP4's register cap (maxnreg).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'
for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _fmt in ("mxfp4", "mxfp4_pairs",):
        _table[_fmt]["PIN"] = 2
        _table[_fmt].pop("maxnreg", None)
PY
grep -q '_table\[_fmt\]\["PIN"\] = 2' atom/model_ops/kernels/w4_gemv1.py
