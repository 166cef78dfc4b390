# Variant: every one-row 4-bit GEMV tile with its scale rows (SPF) and its first 2 steps' lines (EARLY)
# asked of L2 before the PDL wait.
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "SPF=True, EARLY=2"
