# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# the same change as scripts/variants/int4/norm_masked.sh (it is not specific to a format; its header says what it does).
set -e
bash "$(dirname "$0")/../int4/norm_masked.sh"
