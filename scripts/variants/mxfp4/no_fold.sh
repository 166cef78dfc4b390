# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/mxfp4):
# `w4_gemv1.FOLD_PAIR_SCALES` off: MXFP4 pair words' HALF2 loop scales a chain's sum by 2^(e - 127)
# and the E8M0 scale as two floats (a shift, a max for s = 0, a second multiply) instead of one
# float built from the bits e + s - 127 (the same layers take pair words: those whose scale
# bytes fold, `fp4_pairs.FOLD_SCALES`). sm90 (Triton 3.6), loop instructions a step without /
# with the fold: o_proj 410 / 394, gate-up 429 / 418, down 429 / 416, the gated gate-up 436 / 419,
# q/k/v with the norm 295 / 287.
set -e
f=atom/model_ops/kernels/w4_gemv1.py
grep -q '^FOLD_PAIR_SCALES = True$' $f
sed -i 's/^FOLD_PAIR_SCALES = True$/FOLD_PAIR_SCALES = False/' $f
