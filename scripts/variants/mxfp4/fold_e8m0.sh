# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/mxfp4):
# `w4_gemv1.FOLD_PAIR_SCALES` on: MXFP4 pair words' HALF2 chain sum unscaled and scaled by one float
# multiply-add, 2^(e + s - 254) built as the float whose exponent field is e + s - 127 (one
# multiply-add of the scale byte s and x's column exponent e), in place of 2^(e - 127) and the
# E8M0 scale as two floats (a shift, a max for s = 0, a multiply); pair words only for layers
# whose scale bytes lie in `fp4_pairs.FOLD_SCALES` (Llama's dummy weights do). sm90 (Triton 3.6),
# loop instructions a step: o_proj 394 against 410, gate-up 418 / 429, down 416 / 429, the gated
# gate-up 419 / 436, q/k/v with the norm 287 / 295.
set -e
f=atom/model_ops/kernels/w4_gemv1.py
grep -q '^FOLD_PAIR_SCALES = False$' $f
sed -i 's/^FOLD_PAIR_SCALES = False$/FOLD_PAIR_SCALES = True/' $f
