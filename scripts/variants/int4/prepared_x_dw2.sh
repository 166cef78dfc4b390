# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/int4):
# "w4_prepared_x" added to the default fusions, and int4's one-row GEMV tiles reading two words a load
# (DW = 2): with x prepared the compiled loop takes 2.34 instructions a weight against 2.83 with one word
# (`scripts/w4_gemv_sass.py`, Triton 3.9).
set -e
sed -i 's/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words")$/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words", "w4_prepared_x")/' \
  atom/tuning/fusions.py
grep -q '"fp4_pair_words", "w4_prepared_x")' atom/tuning/fusions.py
sed -i 's/^TILES = {"int4": dict(BLOCK_N=8, BLOCK_W=256, num_warps=8, num_stages=3, AHEAD=True, HALF2=True, SPF=True),$/TILES = {"int4": dict(BLOCK_N=8, BLOCK_W=256, num_warps=8, num_stages=3, AHEAD=True, HALF2=True, SPF=True, DW=2),/' \
  atom/model_ops/kernels/w4_gemv1.py
sed -i 's/^TILES_WIDE = {"int4": dict(BLOCK_N=16, BLOCK_W=128, num_warps=4, num_stages=3, HALF2=True, SPF=True),$/TILES_WIDE = {"int4": dict(BLOCK_N=16, BLOCK_W=128, num_warps=4, num_stages=3, HALF2=True, SPF=True, DW=2),/' \
  atom/model_ops/kernels/w4_gemv1.py
test "$(grep -c 'HALF2=True, SPF=True, DW=2),$' atom/model_ops/kernels/w4_gemv1.py)" -ge 2
