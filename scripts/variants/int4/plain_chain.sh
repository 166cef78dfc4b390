# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# int4's plain one-row tiles on the pattern of the gated one (`GATED_TILES`): word pairs in one fp16
# chain (DW = 2, CHAIN), no words ahead. o_proj and q/k/v after down's epilogue (`TILES`): 8 rows over
# 8 warps, sm90 2.43 loop instructions a weight against 3.45, 57 registers, 4 programs an SM as now
# (Llama's o_proj: 0.97 waves); down (`TILES_DEEP`): 8 rows over 4 warps, 2.42 against 3.45, 54
# registers, 9 programs an SM (0.43 waves). `chain_all` kept the words ahead (2.62 a weight, 93
# registers, 2 programs an SM: +4.5% on an H100).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES["int4"] = dict(BLOCK_N=8, BLOCK_W=256, num_warps=8, num_stages=3, HALF2=True, DW=2, CHAIN=True, SPF=True)
TILES_DEEP["int4"] = dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, HALF2=True, DW=2, CHAIN=True, SPF=True)
PY
