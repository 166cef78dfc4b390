# Variant (run inside a copy of the tree by `h200_lease.sh var_thr` with VARIANTS=scripts/variants/mxfp4):
# "mxfp4" and "mxfp4_pairs" products of 1024 rows or more on the weight written out in bf16 and the library GEMM
# (`kernels.w4_gemm.W4_DEQUANT_MIN_M`, the "w4_dequant" route).
set -e
sed -i 's/"mxfp4": 65, "mxfp4_pairs": 65}$/"mxfp4": 1024, "mxfp4_pairs": 1024}/' atom/model_ops/kernels/w4_gemm.py
grep -qF '"mxfp4": 1024, "mxfp4_pairs": 1024}' atom/model_ops/kernels/w4_gemm.py
