# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/int4):
# int4's wide one-row GEMV tile (Llama's gate-up: 16 rows of 128 words, 4 warps) loading the next step's
# words ahead, with room for 128 registers (Triton's maxnreg): ptxas then issues them 225-305
# instructions before their first use (`scripts/w4_gemv_sass.py --loads`; the tile as it is loads a
# step's words at its top and waits for them 43-80 instructions later), at 4 programs an SM instead of 7.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES_WIDE["int4"].update(AHEAD=True, maxnreg=128)
PY
grep -q 'TILES_WIDE\["int4"\].update(AHEAD=True, maxnreg=128)' atom/model_ops/kernels/w4_gemv1.py
