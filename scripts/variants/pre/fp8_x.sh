# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/pre):
# the one-row ptpc FP8 product's tiles that load their words a step ahead load the row's next step too
# (fp8_gemv1.X_AHEAD, the kernel's PRE).
set -e
grep -q '^X_AHEAD = False' atom/model_ops/kernels/fp8_gemv1.py
sed -i 's/^X_AHEAD = False/X_AHEAD = True/' atom/model_ops/kernels/fp8_gemv1.py
grep -q '^X_AHEAD = True' atom/model_ops/kernels/fp8_gemv1.py
