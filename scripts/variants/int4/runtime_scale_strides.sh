# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# int4's even one-row loops with the scale and zero-point rows' strides at runtime, as before
# `w4_gemv1.FIXED_SCALE_STRIDES` compiled them in (sm90 loops: o_proj and down 229 instructions a
# step against 221, q/k/v with the norm inside 274 against 264, gate-up with SiLU inside on
# `GATED_TILES` 534 against 517).
set -e
f=atom/model_ops/kernels/w4_gemv1.py
grep -q '^FIXED_SCALE_STRIDES = {"int4": True, ' $f
sed -i 's/^FIXED_SCALE_STRIDES = {"int4": True, /FIXED_SCALE_STRIDES = {"int4": False, /' $f
grep -q '^FIXED_SCALE_STRIDES = {"int4": False, ' $f
