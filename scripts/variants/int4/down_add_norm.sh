# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# "w4_down_add_norm" added to the default fusions: at batch 1 down's one-row GEMV adds the residual in
# its epilogue and writes the next layer's normed input (h w and the sums of h^2), and the next q/k/v
# is the plain one-row GEMV scaled by 1 / rms (`fusions.w4_normed_qkv`) instead of the GEMV with the
# norm inside.
set -e
grep -q '^        out += ("w4_o_proj_add_norm",)$' atom/tuning/fusions.py
sed -i 's/^        out += ("w4_o_proj_add_norm",)$/        out += ("w4_o_proj_add_norm", "w4_down_add_norm")/' atom/tuning/fusions.py
grep -q '^        out += ("w4_o_proj_add_norm", "w4_down_add_norm")$' atom/tuning/fusions.py
