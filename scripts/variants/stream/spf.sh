# Variant: every one-row 4-bit GEMV tile (the three tables, every format, and both fused
# norm GEMVs') with the program's scale rows asked of L2 before its PDL wait (the kernel's SPF).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

for _table in (TILES, TILES_WIDE, TILES_DEEP):
    for _cfg in _table.values():
        _cfg.update(SPF=True)
FUSED_TILES[False].update(SPF=True)
FUSED_TILES[True].update(SPF=True)
PY
