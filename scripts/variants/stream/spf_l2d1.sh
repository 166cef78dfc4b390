# Variant: every one-row 4-bit GEMV tile with its scale rows asked of L2 at the start (SPF) and L2 prefetches of the step one ahead (L2D).
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "SPF=True, L2D=1"
