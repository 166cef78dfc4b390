# Variant (run inside a copy of the tree by `h200_lease.sh var_thr` with VARIANTS=scripts/variants/int4):
# int4 products of every row count on the 4-bit kernels (`w4_dot` to 64 rows, the tl.dot GEMM past), none on
# the weight written out.
set -e
sed -i 's/^W4_DEQUANT_MIN_M = {"int4": 65,/W4_DEQUANT_MIN_M = {"int4": None,/' atom/model_ops/kernels/w4_gemm.py
grep -qF 'W4_DEQUANT_MIN_M = {"int4": None,' atom/model_ops/kernels/w4_gemm.py
