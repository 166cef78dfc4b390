# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# "w4_o_proj_add_norm" added to the default fusions: at batch 1 o_proj's epilogue adds the residual and writes
# gate-up's input h w with its sums of h^2, and gate-up scales by 1 / rms (no add + RMSNorm kernel between them).
set -e
sed -i 's/out += ("norm+quant", "silu+quant", "w4_norm_gemv")$/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "w4_o_proj_add_norm")/' \
  atom/tuning/fusions.py
grep -q '"w4_norm_gemv", "w4_o_proj_add_norm")' atom/tuning/fusions.py
