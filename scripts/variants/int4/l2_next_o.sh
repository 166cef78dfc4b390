# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# l2_next with o_proj's words only (`fusions.L2_NEXT_BYTES["gate_up_from_qkv"]` = 0: none of gate-up's).
set -e
bash "$(dirname "$0")/l2_next.sh"
f=atom/tuning/fusions.py
grep -q '^    "gate_up_from_qkv": 16 << 20,$' $f
sed -i 's/^    "gate_up_from_qkv": 16 << 20,$/    "gate_up_from_qkv": 0,/' $f
grep -q '^    "gate_up_from_qkv": 0,$' $f
