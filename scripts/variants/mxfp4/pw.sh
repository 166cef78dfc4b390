# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/mxfp4):
# Now the default: on the current tree it changes nothing (`no_pair_words.sh` takes it out).
# "fp4_pair_words" added to the default fusions: MXFP4 layers store their weight as pair words.
set -e
sed -i 's/out += ("norm+quant", "silu+quant", "w4_norm_gemv")$/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words")/' \
  atom/tuning/fusions.py
grep -q '"w4_norm_gemv", "fp4_pair_words")' atom/tuning/fusions.py
