# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/mxfp4):
# `w4_gemv1.EARLY_EPILOGUE` on: gate-up's 1 / rms (RSQ) loads the sums o_proj's epilogue wrote right after
# its PDL wait instead of after its loop, and o_proj's epilogue (EPI_ROW) asks L2 for its norm weight's and
# residual's lines before the loop. The same arithmetic (`test_early_epilogue_operands_change_no_bit`);
# sm90 (`w4_gemv_sass.compile_gemv1`): the sums' load moves from after the loop to before it, int4's
# gate-up tile then takes 62 registers instead of 69 (8 programs an SM instead of 7).
set -e
f=atom/model_ops/kernels/w4_gemv1.py
grep -q '^EARLY_EPILOGUE = False$' $f
sed -i 's/^EARLY_EPILOGUE = False$/EARLY_EPILOGUE = True/' $f
grep -q '^EARLY_EPILOGUE = True$' $f
