# Variant: every one-row 4-bit GEMV tile with the program's scale rows asked of L2 before its PDL wait (SPF).
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "SPF=True"
