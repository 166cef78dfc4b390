# Variant (run inside a copy of the tree by `h200_lease.sh var_thr` with VARIANTS=scripts/variants/fp8):
# row-wise fp8 products on cuBLASLt / torch._scaled_mm with their sums promoted to fp32 (fast
# accumulation off: `tuning.plan.FP8_FAST_ACCUM`, the default of `KernelPlan.fp8_fast_accum`).
set -e
sed -i 's/^FP8_FAST_ACCUM = True$/FP8_FAST_ACCUM = False/' atom/tuning/plan.py
grep -q '^FP8_FAST_ACCUM = False$' atom/tuning/plan.py
