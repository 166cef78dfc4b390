# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/attn):
# `triton_unified.SKIP_EMPTY_SEGMENTS` on: under the in-kernel merge, the split segments a short context leaves
# without keys store no partial and do not count themselves in, and the merge reads only the others.
set -e
sed -i 's/^SKIP_EMPTY_SEGMENTS = False$/SKIP_EMPTY_SEGMENTS = True/' atom/model_ops/attention/triton_unified.py
grep -q '^SKIP_EMPTY_SEGMENTS = True$' atom/model_ops/attention/triton_unified.py
