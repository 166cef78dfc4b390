# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# "fp4_pair_words" and "w4_prepared_x" added to the default fusions: MXFP4 pair words, and gate-up's and
# down's input rows prepared by the norm and SiLU kernels (`kernels.h2_xpack`).
set -e
sed -i 's/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words")$/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words", "w4_prepared_x")/' \
  atom/tuning/fusions.py
grep -q '"fp4_pair_words", "w4_prepared_x")' atom/tuning/fusions.py
