# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/mxfp4):
# MXFP4's one-row GEMV tiles in TILES_DEEP (Llama's down product: its 512 programs of 4 warps fit the
# SMs' registers at 128 as at 64) with their registers capped at 128 instead of 64 (Triton's maxnreg): with
# the room, ptxas issues the words loaded ahead for the next step early in the step instead of at its end
# (`scripts/w4_gemv_sass.py --loads`: 206-264 instructions before the first wait on them at 128, 62-89 at 64).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _table in (TILES_DEEP,):
    for _fmt in ("mxfp4", "mxfp4_pairs"):
        _table[_fmt].update(maxnreg=128)
PY
grep -q 'update(maxnreg=128)' atom/model_ops/kernels/w4_gemv1.py
