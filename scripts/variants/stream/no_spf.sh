# Variant: the one-row 4-bit GEMV tiles without the scale rows' prefetch before the PDL wait (SPF off
# in every table tile): the tree before SPF became the tables' default.
bash "$(dirname "${BASH_SOURCE[0]}")/../tile_options.sh" "SPF=False"
