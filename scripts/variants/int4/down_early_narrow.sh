# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# the variants down_early ("w4_down_add_norm" with the epilogues' operands read early) and
# narrow_both together.
set -e
bash "$(dirname "$0")/down_early.sh"
bash "$(dirname "$0")/narrow_both.sh"
