# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/attn):
# decode steps' attention tiles with `rows_ahead` at 3 stages (each tile's block-table entries loaded a tile
# ahead, so that the K / V tiles get two shared-memory buffers and a program's tiles overlap; compiled for
# sm90 the default keeps one buffer), from `pick_attention_config` for every decode batch.
set -e
f=atom/model_ops/attention/triton_unified.py
[ "$(grep -c '^    num_stages = 2$' $f)" = 1 ] && [ "$(grep -c '^        num_q_blocks=num_q_blocks,$' $f)" = 1 ]
sed -i 's/^    num_stages = 2$/    num_stages = 3 if max_query_len <= 1 else 2/' $f
sed -i 's/^        num_q_blocks=num_q_blocks,$/        num_q_blocks=num_q_blocks, rows_ahead=max_query_len <= 1,/' $f
grep -q 'rows_ahead=max_query_len <= 1,' $f && grep -q 'num_stages = 3 if max_query_len <= 1 else 2' $f
