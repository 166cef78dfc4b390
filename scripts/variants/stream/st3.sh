# Variant: every one-row 4-bit GEMV tile with its loads pipelined through shared memory in three stages (STAGES) instead of the next words carried in registers (AHEAD).
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "AHEAD=False, STAGES=3"
