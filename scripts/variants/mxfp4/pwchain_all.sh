# Variant: pair words and CHAIN in MXFP4's tiles (`pwchain.sh`), and the q/k/v norm GEMV's tile
# (`FUSED_TILES[False]`, both 4-bit formats) with two words a load and CHAIN too.
set -e
here=$(dirname "${BASH_SOURCE[0]}")
bash "$here/pwchain.sh"
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

FUSED_TILES[False].update(DW=2, CHAIN=True)
PY
