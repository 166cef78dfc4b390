# Variant: the one-row ptpc FP8 product (`fp8_gemv1`) loading its weight scales before the PDL wait
# and x's scale right after it (SCALES_FIRST), not at each program's end.
set -e
cat >> atom/model_ops/kernels/fp8_gemv1.py <<'PY'

SCALES_FIRST = True
PY
