# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# MXFP4's table tile for layers of up to WIDE_N outputs and K up to DEEP_K (o_proj) over 4 warps with
# 128 word pairs a step instead of 8 warps with 256, the geometry of the q/k/v GEMV's tile that ran
# q/k/v faster than the 8-warp one (docs/perf 2026-12-07d). sm90: 62 registers, 429 loop instructions
# a step for 128 weights a thread (the 8-warp tile: 62, 410).
set -e
f=atom/model_ops/kernels/w4_gemv1.py
grep -q '^         "mxfp4": dict(BLOCK_N=8, BLOCK_W=256, num_warps=8, num_stages=3, AHEAD=True, HALF2=True, DW=2, SPF=True)}$' $f
sed -i 's/^         "mxfp4": dict(BLOCK_N=8, BLOCK_W=256, num_warps=8, num_stages=3, AHEAD=True, HALF2=True, DW=2, SPF=True)}$/         "mxfp4": dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True, HALF2=True, DW=2, SPF=True)}/' $f
grep -q '^         "mxfp4": dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True, HALF2=True, DW=2, SPF=True)}$' $f
