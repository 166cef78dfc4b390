# Variant: every one-row 4-bit GEMV tile (the three tables, every format, and the q/k/v norm
# GEMV's) with the loop's loads pipelined through shared memory, three stages (the kernel's STAGES), instead of the next words carried in registers (AHEAD).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _cfg in _table.values():
        _cfg.update(AHEAD=False, STAGES=3)
FUSED_TILES[False].update(AHEAD=False, STAGES=3)
PY
