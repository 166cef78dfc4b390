# Variant: both `pw.sh` and `chain.sh`.
set -e
here=$(dirname "${BASH_SOURCE[0]}")
bash "$here/pw.sh"
bash "$here/chain.sh"
