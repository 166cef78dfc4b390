# Variant: every one-row 4-bit GEMV tile without the next words carried (AHEAD off: each step
# loads its own words, which L2D asked of L2 a step before), the scale rows asked of L2 at the
# start (SPF).
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "AHEAD=False, SPF=True, L2D=1"
