# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/fp8):
# one-row ptpc FP8 products back on the tensor-core swap-AB kernel (`quant.common.ONE_ROW_FP8`
# off), the tree before `kernels.fp8_gemv1` ran them.
set -e
sed -i 's/^ONE_ROW_FP8 = True$/ONE_ROW_FP8 = False/' atom/model_ops/quant/common.py
grep -q '^ONE_ROW_FP8 = False$' atom/model_ops/quant/common.py
