# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/fp8):
# "quant_on_load" for o_proj only (the attention's output, K 4096, quantized on load by the one-row
# product on 8-row tiles); down keeps SiLU-and-mul's quantizer (its K 14336 is the costlier row to
# quantize again in every program).
set -e
bash "$(dirname "$0")/quant_on_load_8rows.sh"
sed -i 's/    if plan.has("quant_on_load") and iq.per_token and y.shape\[0\] <= QUANT_ON_LOAD_MAX_ROWS \\$/    if False and plan.has("quant_on_load") and iq.per_token and y.shape[0] <= QUANT_ON_LOAD_MAX_ROWS \\/' \
  atom/tuning/fusions.py
grep -q '    if False and plan.has("quant_on_load")' atom/tuning/fusions.py
