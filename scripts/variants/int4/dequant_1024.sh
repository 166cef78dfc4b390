# Variant (run inside a copy of the tree by `h200_lease.sh var_thr` with VARIANTS=scripts/variants/int4):
# "int4" products of 1024 rows or more on the weight written out in bf16 and the library GEMM
# (`kernels.w4_gemm.W4_DEQUANT_MIN_M`, the "w4_dequant" route).
set -e
sed -i 's/^W4_DEQUANT_MIN_M = {"int4": 65,/W4_DEQUANT_MIN_M = {"int4": 1024,/' atom/model_ops/kernels/w4_gemm.py
grep -qF '"int4": 1024,' atom/model_ops/kernels/w4_gemm.py
