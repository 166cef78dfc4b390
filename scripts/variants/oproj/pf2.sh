# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/oproj):
# "o_proj_l2_prefetch" added to the default fusions, each early program of o_proj's one-row product
# fetching the weight rows of 2 program(s) into L2 before its PDL wait (fusions.O_PROJ_PREFETCH = 2).
set -e
grep -q '^        out += ("w4_o_proj_add_norm",)$' atom/tuning/fusions.py
sed -i 's/^        out += ("w4_o_proj_add_norm",)$/        out += ("w4_o_proj_add_norm", "o_proj_l2_prefetch")/' atom/tuning/fusions.py
grep -q '^O_PROJ_PREFETCH = 2$' atom/tuning/fusions.py
sed -i 's/^O_PROJ_PREFETCH = 2$/O_PROJ_PREFETCH = 2/' atom/tuning/fusions.py
grep -q 'out += ("w4_o_proj_add_norm", "o_proj_l2_prefetch")' atom/tuning/fusions.py
grep -q '^O_PROJ_PREFETCH = 2$' atom/tuning/fusions.py
