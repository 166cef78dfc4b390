# Variant: every one-row 4-bit GEMV tile (the three tables, every format, and the q/k/v norm
# GEMV's) with three pipelined stages (STAGES) with L2 prefetches two steps ahead (L2D).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _cfg in _table.values():
        _cfg.update(AHEAD=False, STAGES=3, L2D=2)
FUSED_TILES[False].update(AHEAD=False, STAGES=3, L2D=2)
PY
