# Variant: every one-row 4-bit GEMV tile with three pipelined stages (STAGES) and L2 prefetches two steps ahead (L2D).
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "AHEAD=False, STAGES=3, L2D=2"
