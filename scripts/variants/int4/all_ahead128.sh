# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/int4):
# int4's one-row GEMV tiles in all three tables with room for 128 registers (Triton's maxnreg), the
# wide tile (Llama's gate-up) also loading the next step's words ahead as the others do: with the
# room ptxas issues them earlier in the step (`scripts/w4_gemv_sass.py --loads`: the narrow tile's
# cover goes from 113-159 instructions at its 59 registers to 142-172 at 70; the wide tile's from
# 43-80 without the words ahead to 225-305).
set -e
cat >> atom/model_ops/kernels/w4_gemv1.py <<'PY'

TILES_WIDE["int4"].update(AHEAD=True)
for _table in (TILES, TILES_WIDE, TILES_DEEP):
    _table["int4"].update(maxnreg=128)
PY
grep -q '_table\["int4"\].update(maxnreg=128)' atom/model_ops/kernels/w4_gemv1.py
