# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# `gated_chain8` without the register cap, i.e. int4's `GATED_TILES` tile for MXFP4: 8 gate + 8 up rows
# over 2 warps, word pairs in one fp16 chain, no words ahead. sm90 (Triton 3.6): 736 instructions a
# step of 256 weights (2.88 a weight against the table's 3.41), 70 registers, 14 programs an SM,
# Llama's 1,792 programs in 0.97 waves (at maxnreg 64: 62 registers, 16 an SM, 0.85 waves).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

GATED_TILES["mxfp4_pairs"] = dict(GATED_TILES["int4"])
GATED_TILES["mxfp4"] = dict(GATED_TILES["int4"])
PY
