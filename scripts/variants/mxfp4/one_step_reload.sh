# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/mxfp4):
# the one-row 4-bit GEMV's rows of one step (fixed strides) reload their words in the loop again, unused,
# as before the loop skipped the load ahead where the row stride is the step.
set -e
sed -i 's/^                    if SW == STEP:$/                    if SW == -1:/' atom/model_ops/kernels/w4_gemv1.py
grep -q '^                    if SW == -1:$' atom/model_ops/kernels/w4_gemv1.py
