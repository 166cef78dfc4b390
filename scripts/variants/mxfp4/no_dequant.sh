# Variant (run inside a copy of the tree by `h200_lease.sh var_thr` with VARIANTS=scripts/variants/mxfp4):
# MXFP4 products of every row count on the 4-bit kernels (`w4_dot` past 4 rows), none on the weight written out.
set -e
sed -i 's/"mxfp4": 65, "mxfp4_pairs": 65}$/"mxfp4": None, "mxfp4_pairs": None}/' atom/model_ops/kernels/w4_gemm.py
grep -qF '"mxfp4": None, "mxfp4_pairs": None}' atom/model_ops/kernels/w4_gemm.py
