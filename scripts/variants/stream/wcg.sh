# Variant: every one-row 4-bit GEMV tile (the three tables, every format, and the q/k/v norm
# GEMV's) with its word loads cached in L2 only (the kernel's WCACHE ".cg").
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _cfg in _table.values():
        _cfg.update(WCACHE=".cg")
FUSED_TILES[False].update(WCACHE=".cg")
PY
