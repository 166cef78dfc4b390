# Variant: every one-row 4-bit GEMV tile with L2 prefetches of the step one ahead (the kernel's L2D).
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "L2D=1"
