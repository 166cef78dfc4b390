# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/attn):
# `triton_unified.SEG_MIN_TILES` = 2: under the in-kernel merge, a decode token's context is cut into as many
# segments as hold two KV tiles (at most the launch's 16 splits), the programs past them returning at once.
set -e
sed -i 's/^SEG_MIN_TILES = 0$/SEG_MIN_TILES = 2/' atom/model_ops/attention/triton_unified.py
grep -q '^SEG_MIN_TILES = 2$' atom/model_ops/attention/triton_unified.py
