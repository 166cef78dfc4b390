# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# the plain products' narrow tile over 4 warps, 128 words (pairs) a step, in both formats: int4's
# (`narrow_4w.sh` here) and MXFP4's (scripts/variants/mxfp4/narrow_4w.sh), so that one stage times both.
set -e
d=$(dirname "$0")
bash "$d/narrow_4w.sh"
bash "$d/../mxfp4/narrow_4w.sh"
