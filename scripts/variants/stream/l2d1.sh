# Variant: every one-row 4-bit GEMV tile (the three tables, every format, and the q/k/v norm
# GEMV's) with L2 prefetches of the step one ahead (the kernel's L2D).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _cfg in _table.values():
        _cfg.update(L2D=1)
FUSED_TILES[False].update(L2D=1)
PY
