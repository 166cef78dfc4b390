# Variant: MXFP4 on pair words (`pw.sh`) with CHAIN in its tiles (`chain_mx.sh`).
set -e
here=$(dirname "${BASH_SOURCE[0]}")
bash "$here/pw.sh"
bash "$here/chain_mx.sh"
