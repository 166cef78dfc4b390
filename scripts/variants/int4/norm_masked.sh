# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# the q/k/v GEMV with the norm inside (`w4_gemv1`'s NORM) loading the residual and the norm weight
# with the step's column mask on even tiles too, as before the even tiles dropped it (an always-true
# mask: a compare and a predicate a load; sm90 loop with the rows 16-byte aligned, as launches
# specialize them: 272 instructions a step against 264 for int4, 302 against 295 for MXFP4 pair words).
set -e
f=atom/model_ops/kernels/w4_gemv1.py
grep -q 'add_norm_cols(xv, xo, None, r_ptr' $f
sed -i 's/add_norm_cols(xv, xo, None, r_ptr/add_norm_cols(xv, xo, x_ok, r_ptr/' $f
! grep -q 'add_norm_cols(xv, xo, None' $f
