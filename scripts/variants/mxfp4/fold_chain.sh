# Variant: `fold_e8m0` and CHAIN in MXFP4's tiles (`chain_mx`; the gated gate-up takes the wide
# tile's): a word pair's products in one fp16 chain, so one widening and one scale multiply-add
# per 16 weights. sm90 (Triton 3.6), loop instructions a step: o_proj 367 against 410, gate-up
# 386 / 429, down 392 / 429.
set -e
bash "$(dirname "${BASH_SOURCE[0]}")/fold_e8m0.sh"
bash "$(dirname "${BASH_SOURCE[0]}")/chain_mx.sh"
