# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/fp8):
# "quant_on_load" as in quant_on_load.sh, its one-row products on 8-row tiles (8 rows over 8 warps,
# 256 double-word loads a step): the row's quantization shared by twice the rows.
set -e
sed -i 's/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words")$/out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words", "quant_on_load")/' \
  atom/tuning/fusions.py
grep -q '"fp4_pair_words", "quant_on_load")' atom/tuning/fusions.py
cat >> atom/model_ops/kernels/fp8_gemv1.py <<'PY'

_pending_launch_4_rows = fp8_gemv1_pending_launch


def fp8_gemv1_pending_launch(p, w, ws, bias=None, out_dtype=torch.bfloat16, tile=None):
    N, K = w.shape
    eight = (8, 256, 8, 2, True)
    return _pending_launch_4_rows(p, w, ws, bias, out_dtype, tile or (eight if even(N, K, eight) else None))
PY
