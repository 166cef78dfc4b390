# Variant: the one-row ptpc FP8 product (`fp8_gemv1`) with its weight loads cached in L2 only
# (WORD_CACHE ".cg"), so that the weight stream does not evict the row x from L1.
set -e
cat >> atom/model_ops/kernels/fp8_gemv1.py <<'PY'

WORD_CACHE = ".cg"
PY
