# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# MXFP4's gated one-row product (gate-up with SiLU inside, "w4_gate_up_silu") at 8 gate + 8 up rows
# over 2 warps, word pairs in one fp16 chain (CHAIN), no words ahead, maxnreg 64: sm90 2.88
# instructions a weight for pair words against 3.41 (738 a step of 256 weights against 436 of 128),
# 62 registers, no spills, 16 programs an SM, Llama's 1,792 programs in 0.85 waves against 3,584 in
# 1.70. CHAIN rounds otherwise (one fp16 chain for 16 columns), within the reference's tolerance.
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

GATED_TILES["mxfp4_pairs"] = dict(GATED_TILES["int4"], maxnreg=64)
GATED_TILES["mxfp4"] = dict(GATED_TILES["mxfp4_pairs"])
PY
