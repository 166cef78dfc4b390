# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# l2_next with 32 MiB of gate-up's words instead of 16 (`fusions.L2_NEXT_GATE_UP_BYTES`).
set -e
bash "$(dirname "$0")/l2_next.sh"
f=atom/tuning/fusions.py
grep -q '^L2_NEXT_GATE_UP_BYTES = 16 << 20$' $f
sed -i 's/^L2_NEXT_GATE_UP_BYTES = 16 << 20$/L2_NEXT_GATE_UP_BYTES = 32 << 20/' $f
grep -q '^L2_NEXT_GATE_UP_BYTES = 32 << 20$' $f
