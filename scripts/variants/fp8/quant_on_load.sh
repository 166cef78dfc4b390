# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/fp8):
# "quant_on_load" added to the default fusions: at one row o_proj and down (`fp8_gemv1`, QX)
# quantize the attention's output and SiLU-and-mul's rows as they load them, from partial amaxes,
# instead of the quantizer launches in front.
set -e
sed -i 's/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words")$/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words", "quant_on_load")/' \
  atom/tuning/fusions.py
grep -q '"fp4_pair_words", "quant_on_load")' atom/tuning/fusions.py
