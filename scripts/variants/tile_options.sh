# Used by the variants in stream/: appends to the copy's w4_gemv1.py an update of every one-row
# 4-bit GEMV tile (the three tables, every format, and both fused norm GEMVs' tiles) with the
# keyword arguments in $1, e.g. "L2D=2" (the launcher drops what a product cannot take: L2D
# for a gated product). Not a variant itself (the lease runs the *.sh of one folder).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<PY

for _table in (TILES, TILES_WIDE, TILES_DEEP, FUSED_TILES):
    for _cfg in _table.values():
        _cfg.update($1)
PY
