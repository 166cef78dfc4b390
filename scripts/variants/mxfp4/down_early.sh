# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# the variants down_add_norm and early_epilogue together (down's epilogue and q/k/v's 1 / rms then read
# their operands early too).
set -e
bash "$(dirname "$0")/down_add_norm.sh"
bash "$(dirname "$0")/early_epilogue.sh"
