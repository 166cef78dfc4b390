# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/fp8):
# the activation quantizers dividing each value with `div_rn` (the tree before `act_quant.div_by`:
# the same quotients, ~10 more instructions a value).
set -e
sed -i 's/^        v = div_by(v, scale)$/        v = tl.math.div_rn(v, scale)/' atom/model_ops/kernels/act_quant.py
grep -q '^        v = tl.math.div_rn(v, scale)$' atom/model_ops/kernels/act_quant.py
