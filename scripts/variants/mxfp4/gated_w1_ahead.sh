# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# MXFP4's gated one-row product (gate-up with SiLU inside, "w4_gate_up_silu") at 8 gate + 8 up rows a
# one-warp program, word pairs in one fp16 chain, the next words loaded a step ahead, no register cap.
# sm90 (Triton 3.6): 706 instructions a step of 256 weights (2.76 a weight against the table's 3.41),
# 78 registers, 25 programs an SM, Llama's 1,792 programs in 0.54 waves.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

GATED_TILES["mxfp4_pairs"] = dict(BLOCK_N=8, BLOCK_W=32, num_warps=1, num_stages=3, HALF2=True, DW=2, CHAIN=True,
                                  AHEAD=True, SPF=True)
GATED_TILES["mxfp4"] = dict(GATED_TILES["mxfp4_pairs"])
PY
