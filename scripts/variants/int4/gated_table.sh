# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# int4's gated one-row product (gate-up with SiLU inside, "w4_gate_up_silu") on `tiles`' wide tile
# with half its rows (8 gate + 8 up rows over 4 warps, one word a load), as before
# `w4_gemv1.GATED_TILES` gave it 8 + 8 rows over 2 warps with word pairs in one fp16 chain.
set -e
f=atom/model_ops/kernels/w4_gemv1.py
grep -q '^GATED_TILES = {"int4": dict(' $f
sed -i 's/^GATED_TILES = {"int4": dict(.*$/GATED_TILES = {}/' $f
grep -q '^GATED_TILES = {}$' $f
