# Variant: SPF in every one-row 4-bit GEMV tile, and MXFP4's tiles with their registers capped at 64
# (Triton's maxnreg).
set -e
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "SPF=True"
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _fmt in ("mxfp4", "mxfp4_pairs"):
        _table[_fmt].update(maxnreg=64)
PY
