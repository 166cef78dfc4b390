# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/pre):
# as pre_s.sh, and the next step's x too where the loop reads x as it is (the kernel's PRE).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'
for _table in (TILES, TILES_WIDE, TILES_DEEP, FUSED_TILES):
    for _cfg in _table.values():
        if _cfg.get("AHEAD"):
            _cfg.update(PRE=True, PRE_XT=True)
PY
