# Variant (run inside a copy of the tree by `h200_lease.sh var_thr` with VARIANTS=scripts/variants/mxfp4):
# Now the default: on the current tree it changes nothing (`no_dequant.sh` takes it out).
# "mxfp4" and "mxfp4_pairs" products of 65 rows or more on the weight written out in bf16 and the library GEMM
# (`kernels.w4_gemm.W4_DEQUANT_MIN_M`, the "w4_dequant" route).
set -e
sed -i 's/"mxfp4": None, "mxfp4_pairs": None}$/"mxfp4": 65, "mxfp4_pairs": 65}/' atom/model_ops/kernels/w4_gemm.py
grep -qF '"mxfp4": 65, "mxfp4_pairs": 65}' atom/model_ops/kernels/w4_gemm.py
