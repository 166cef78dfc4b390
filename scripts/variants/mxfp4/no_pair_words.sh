# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# "fp4_pair_words" taken out of the default fusions: MXFP4 layers keep the checkpoint's byte layout.
set -e
sed -i 's/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words")$/out += ("norm+quant", "silu+quant", "w4_norm_gemv")/' \
  atom/tuning/fusions.py
! grep -q '"fp4_pair_words")$' atom/tuning/fusions.py
