# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# l2_next with every stage on (`fusions.L2_NEXT_BYTES`, 16 MiB each): q/k/v asks L2 for o_proj's
# words and gate-up's first 16 MiB, o_proj for gate-up's next 16 MiB, gate-up for down's first
# 16 MiB, down for the next layer's q/k/v words: each product one ahead of the weight stream.
set -e
bash "$(dirname "$0")/l2_next.sh"
f=atom/tuning/fusions.py
for key in gate_up_from_o_proj down_from_gate_up qkv_from_down; do
  grep -q "^    \"$key\": 0,\$" $f
  sed -i "s/^    \"$key\": 0,\$/    \"$key\": 16 << 20,/" $f
  grep -q "^    \"$key\": 16 << 20,\$" $f
done
