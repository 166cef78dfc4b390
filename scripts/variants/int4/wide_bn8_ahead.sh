# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/int4):
# int4's wide one-row GEMV tile (Llama's gate-up, 28672 x 4096) as 8 rows over 4 warps with the
# next step's words loaded ahead (the narrow tile's loop on half its warps) instead of 16 rows
# without them: ptxas leaves that loop at 54 registers and issues most of the words a step
# ahead (`scripts/w4_gemv_sass.py`; the 16-row tile waits for a step's words 43-80 instructions
# after loading them).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES_WIDE["int4"] = dict(TILES["int4"], BLOCK_W=128, num_warps=4)
PY
grep -q 'TILES_WIDE\["int4"\] = dict(TILES\["int4"\], BLOCK_W=128, num_warps=4)' atom/model_ops/kernels/w4_gemv1.py
