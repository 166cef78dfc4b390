# Variant (run inside a copy of the tree by `h200_lease.sh var_kv` with VARIANTS=scripts/variants/attn):
# decode batches over an FP8 KV cache read 64-key tiles at every batch size, as bf16's (the tree
# before 6693367; the tree: 128-key tiles from `FP8_WIDE_TILE_MIN_SEQS` sequences).
set -e
sed -i 's/^FP8_WIDE_TILE_MIN_SEQS = [0-9]*$/FP8_WIDE_TILE_MIN_SEQS = 1 << 30/' atom/model_ops/attention/triton_unified.py
grep -q "^FP8_WIDE_TILE_MIN_SEQS = 1 << 30$" atom/model_ops/attention/triton_unified.py
