# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# int4's table tile for layers of up to WIDE_N outputs (o_proj; down through TILES_DEEP, a copy of it)
# over 4 warps with 128 words a step instead of 8 warps with 256: the geometry of the q/k/v GEMV's
# tile (`FUSED_TILES[False]`), which ran q/k/v 0.73 us faster than this 8-warp tile in a PDL-off
# decode profile (docs/perf 2026-12-07d). sm90: 54 registers, 227 loop instructions a step (59 / 229).
set -e
f=atom/model_ops/kernels/w4_gemv1.py
grep -q '^TILES = {"int4": dict(BLOCK_N=8, BLOCK_W=256, num_warps=8, num_stages=3, AHEAD=True' $f
sed -i 's/^TILES = {"int4": dict(BLOCK_N=8, BLOCK_W=256, num_warps=8, num_stages=3, AHEAD=True/TILES = {"int4": dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True/' $f
grep -q '^TILES = {"int4": dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True' $f
