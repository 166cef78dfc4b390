# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# the q/k/v GEMV with the norm inside (`w4_gemv1.FUSED_TILES[False]`, both formats' tile) launched under
# Triton's maxnreg = 80. sm90 (`scripts/w4_gemv_sass.py`): int4 78 registers instead of 83, no spills,
# 379 loop instructions a step instead of 367, 6 programs an SM instead of 5: Llama's 768 q/k/v programs
# in one wave (0.97) instead of 1.16, whose second wave runs ~1 program an SM. MXFP4 pair words: 78
# instead of 75, 6 programs an SM either way.
set -e
f=atom/model_ops/kernels/w4_gemv1.py
a='^FUSED_TILES = {False: dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True, HALF2=True, SPF=True),$'
grep -q "$a" $f
sed -i 's/^FUSED_TILES = {False: dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True, HALF2=True, SPF=True),$/FUSED_TILES = {False: dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True, HALF2=True, SPF=True, maxnreg=80),/' $f
grep -q 'SPF=True, maxnreg=80),$' $f
