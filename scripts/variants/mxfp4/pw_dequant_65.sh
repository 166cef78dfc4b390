# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# pair words (`pw.sh`) with products of 65 rows or more on the weight written out (`dequant_65.sh`).
set -e
here=$(dirname "${BASH_SOURCE[0]}")
bash "$here/pw.sh"
bash "$here/dequant_65.sh"
