# Variant (run inside a copy of the tree by `h200_lease.sh var_kv` with VARIANTS=scripts/variants/attn):
# decode batches over an FP8 KV cache read 128-key tiles at every batch size (the tree: from
# `FP8_WIDE_TILE_MIN_SEQS` sequences; before 6693367, 64-key tiles at all of them), as timed in
# docs/perf against the tree before.
set -e
sed -i 's/^FP8_WIDE_TILE_MIN_SEQS = [0-9]*$/FP8_WIDE_TILE_MIN_SEQS = 1/' atom/model_ops/attention/triton_unified.py
grep -q "^FP8_WIDE_TILE_MIN_SEQS = 1$" atom/model_ops/attention/triton_unified.py
