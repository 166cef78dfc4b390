# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# the variants nreg_early and narrow_both together.
set -e
bash "$(dirname "$0")/nreg_early.sh"
bash "$(dirname "$0")/narrow_both.sh"
