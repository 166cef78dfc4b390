# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/pre):
# every table tile of the one-row 4-bit GEMV that loads its words a step ahead (AHEAD) loads the next
# step's scales with them too (the kernel's PRE, PRE_XT False).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'
for _table in (TILES, TILES_WIDE, TILES_DEEP, FUSED_TILES):
    for _cfg in _table.values():
        if _cfg.get("AHEAD"):
            _cfg.update(PRE=True, PRE_XT=False)
PY
