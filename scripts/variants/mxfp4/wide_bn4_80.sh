# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/mxfp4):
# MXFP4's wide one-row GEMV tile (Llama's gate-up, 28672 x 4096) at 4 rows a program instead of 8,
# its registers capped at 80: ptxas then issues the next step's words well before their use
# (`scripts/w4_gemv_sass.py` on this tile: 118-121 instructions of a 255-instruction step at 64
# registers, 176-182 at 80 with 77 registers; the 8-row tile 64-89 of 429), at ~19% more
# instructions a weight (x's columns shared by 4 rows instead of 8).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _f in ("mxfp4", "mxfp4_pairs"):
    TILES_WIDE[_f].update(BLOCK_N=4, maxnreg=80)
PY
grep -q 'TILES_WIDE\[_f\].update(BLOCK_N=4, maxnreg=80)' atom/model_ops/kernels/w4_gemv1.py
