# Variant: every one-row 4-bit GEMV tile with its word loads cached in L2 only (WCACHE ".cg"),
# the scale rows asked of L1 and L2 at the start (SPF, PF1) and the next step of L2 (L2D).
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "WCACHE=\".cg\", SPF=True, PF1=True, L2D=1"
