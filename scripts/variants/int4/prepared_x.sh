# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# "w4_prepared_x" added to the default fusions: at batch 1 the add + RMSNorm and SiLU-and-mul kernels
# write gate-up's and down's input rows prepared for the 4-bit GEMV's fp16 pair products (`kernels.h2_xpack`).
set -e
sed -i 's/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words")$/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words", "w4_prepared_x")/' \
  atom/tuning/fusions.py
grep -q '"fp4_pair_words", "w4_prepared_x")' atom/tuning/fusions.py
