# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/int4):
# int4's wide one-row GEMV tile (Llama's gate-up: 16 rows of 128 words, 4 warps) as it is, its
# registers capped at 128 (Triton's maxnreg) instead of left to ptxas: it then takes 77 registers
# instead of 69 and issues a step's words earlier (`scripts/w4_gemv_sass.py --tables 128`: 79-115
# instructions before their first use instead of 43-80), at 6 programs an SM instead of 7.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES_WIDE["int4"].update(maxnreg=128)
PY
grep -q 'TILES_WIDE\["int4"\].update(maxnreg=128)' atom/model_ops/kernels/w4_gemv1.py
