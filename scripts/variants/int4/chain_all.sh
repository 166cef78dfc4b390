# Variant: int4's table tiles with two words a load and CHAIN (`chain.sh`), and the q/k/v norm
# GEMV's tile (`FUSED_TILES[False]`, both 4-bit formats) with them too.
set -e
here=$(dirname "${BASH_SOURCE[0]}")
bash "$here/chain.sh"
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

FUSED_TILES[False].update(DW=2, CHAIN=True)
PY
