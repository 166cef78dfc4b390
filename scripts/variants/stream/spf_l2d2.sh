# Variant: every one-row 4-bit GEMV tile with its scale rows asked of L2 at the start (SPF) and L2 prefetches two steps ahead (L2D).
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "SPF=True, L2D=2"
