# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# the variants fused_nreg80 and early_epilogue together (q/k/v's norm GEMV under maxnreg 80, and
# the epilogues' operands read before the loop).
set -e
bash "$(dirname "$0")/fused_nreg80.sh"
bash "$(dirname "$0")/early_epilogue.sh"
