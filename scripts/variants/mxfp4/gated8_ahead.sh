# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/mxfp4):
# MXFP4's gated one-row product (gate-up with SiLU inside) at 8 gate + 8 up rows over 2 warps (x's
# columns shared by 16 rows, as int4's `GATED_TILES` tile), the next step's words loaded ahead, no
# CHAIN, no register cap. sm90 (Triton 3.6) with the fold: 2.92 loop instructions a weight against
# the table's 3.27, 94 registers, 10 programs an SM, Llama's 1,792 programs in 1.36 waves.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

GATED_TILES["mxfp4_pairs"] = dict(BLOCK_N=8, BLOCK_W=64, num_warps=2, num_stages=3, AHEAD=True, HALF2=True, DW=2,
                                  SPF=True)
GATED_TILES["mxfp4"] = dict(GATED_TILES["mxfp4_pairs"])
PY
