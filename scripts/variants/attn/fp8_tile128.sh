# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/attn):
# decode steps over an FP8 KV cache with 128-key tiles instead of 64 (4 warps, 2 stages): the same
# bytes a tile as bf16's 64 keys.
set -e
python3 - <<'PY'
p = "atom/model_ops/attention/triton_unified.py"
s = open(p).read()
old = "                         workspace.max_splits if workspace else 16)\n"
assert s.count(old) == 1
s = s.replace(old, old + "    if k_cache.dtype in FP8_CACHE_DTYPES and max_query_len <= 1:\n        cfg = dict(cfg, TILE_N=128)\n")
open(p, "w").write(s)
PY
grep -q "cfg = dict(cfg, TILE_N=128)" atom/model_ops/attention/triton_unified.py
