# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/attn):
# decode steps' attention tiles with `rows_ahead` at 3 stages (each tile's block-table entries loaded a tile
# ahead, so that the K / V tiles get two shared-memory buffers and a program's tiles overlap; compiled for
# sm90 the default keeps one buffer), from `pick_attention_config` for every decode batch.
set -e
python3 - <<'PY'
p = "atom/model_ops/attention/triton_unified.py"
s = open(p).read()
old = """    num_stages = 2
    if device.type != "cuda":
        num_stages = 1
    return dict(
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, HEAD_PAD=head_pad,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        num_q_blocks=num_q_blocks,
    )"""
new = """    num_stages = 3 if max_query_len <= 1 else 2
    if device.type != "cuda":
        num_stages = 1
    return dict(
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, HEAD_PAD=head_pad,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        num_q_blocks=num_q_blocks, rows_ahead=max_query_len <= 1,
    )"""
assert s.count(old) == 1, "pick_attention_config's return changed: update this variant"
open(p, "w").write(s.replace(old, new))
PY
