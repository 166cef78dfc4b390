# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# int4's gated one-row loop (gate-up with SiLU inside, no words ahead) with the words' row stride
# compiled in as well as the scales' (SW, SS, SZ): sm90 320 instructions a step against 332, 45
# registers against 59, 10 programs an SM against 8. The tiles with the words ahead keep runtime
# word strides (`FIXED_STRIDES`: slower for int4 there).
set -e
f=atom/model_ops/kernels/w4_gemv1.py
a='    elif cfg.get("AHEAD") and FIXED_STRIDES[FORMATS[fmt_id]]:  # one compile per weight shape'
grep -qF "$a" $f
sed -i 's/^    elif cfg.get("AHEAD") and FIXED_STRIDES\[FORMATS\[fmt_id\]\]:  # one compile per weight shape$/    elif (cfg.get("AHEAD") and FIXED_STRIDES[FORMATS[fmt_id]]) or (cfg.get("GATED") and not cfg.get("AHEAD") and fmt_id == 0):/' $f
grep -qF 'or (cfg.get("GATED") and not cfg.get("AHEAD") and fmt_id == 0):' $f
