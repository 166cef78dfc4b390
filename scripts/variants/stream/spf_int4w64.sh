# Variant: SPF in every one-row 4-bit GEMV tile, and int4's wide tile with its registers capped at 64.
set -e
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "SPF=True"
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES_WIDE["int4"].update(maxnreg=64)
PY
