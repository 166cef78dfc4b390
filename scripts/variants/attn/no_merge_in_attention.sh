# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/attn):
# "merge_in_attention" taken out of the default fusions: split decode attention writes its partials and
# `_merge_kernel` merges them in a launch of its own (the tree before the in-kernel merge became a default).
set -e
sed -i 's/^            out += ("merge_in_attention",)$/            pass/' atom/tuning/fusions.py
! grep -q '"merge_in_attention",)' atom/tuning/fusions.py
