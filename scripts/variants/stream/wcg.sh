# Variant: every one-row 4-bit GEMV tile with its word loads cached in L2 only (WCACHE ".cg").
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "WCACHE=\".cg\""
