# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# "w4_prepared_x" and "w4_o_proj_norm" added to the default fusions: prepared rows for gate-up and down, and
# o_proj's epilogue adding the residual and preparing gate-up's input (no add + RMSNorm kernel between them).
set -e
sed -i 's/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words")$/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words", "w4_prepared_x", "w4_o_proj_norm")/' \
  atom/tuning/fusions.py
grep -q '"w4_prepared_x", "w4_o_proj_norm")' atom/tuning/fusions.py
