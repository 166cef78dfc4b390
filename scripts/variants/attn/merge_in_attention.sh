# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/attn):
# "merge_in_attention" added to the default fusions: split decode attention merges its segments in
# the kernel (the last segment's program, `attention.split_merge`) instead of `_merge_kernel`'s launch.
set -e
sed -i 's/out += ("norm+quant", "silu+quant", "w4_norm_gemv")$/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "merge_in_attention")/' \
  atom/tuning/fusions.py
grep -q '"w4_norm_gemv", "merge_in_attention")' atom/tuning/fusions.py
