# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# "w4_gate_up_silu" added to the default fusions: at batch 1 gate-up's one-row GEMV (after o_proj's
# add + norm epilogue) applies SiLU-and-mul itself, a program's gate and up rows side by side
# (`w4_gemv1.gated_tiles`), and the SiLU-and-mul kernel does not run.
set -e
grep -q '^        out += ("w4_o_proj_add_norm",)$' atom/tuning/fusions.py
sed -i 's/^        out += ("w4_o_proj_add_norm",)$/        out += ("w4_o_proj_add_norm", "w4_gate_up_silu")/' atom/tuning/fusions.py
grep -q '^        out += ("w4_o_proj_add_norm", "w4_gate_up_silu")$' atom/tuning/fusions.py
