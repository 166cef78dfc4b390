# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# "w4_l2_next" added to the default fusions: at batch 1 the q/k/v GEMV with the norm inside asks L2,
# after its loop, for o_proj's words and the first 16 MiB of gate-up's (one bulk prefetch a warp,
# `w4_gemv1`'s L2N), so that they stream from memory while the attention runs.
set -e
f=atom/tuning/fusions.py
grep -q '^        out += ("w4_o_proj_add_norm",)$' $f
sed -i 's/^        out += ("w4_o_proj_add_norm",)$/        out += ("w4_o_proj_add_norm", "w4_l2_next")/' $f
grep -q '^        out += ("w4_o_proj_add_norm", "w4_l2_next")$' $f
