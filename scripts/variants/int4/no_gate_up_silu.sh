# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/int4):
# "w4_gate_up_silu" taken out of the default fusions: at batch 1 gate-up's one-row GEMV (after o_proj's
# add + norm epilogue) writes the gate and up rows, and the SiLU-and-mul kernel runs before down (the tree
# before the fusion became a default).
set -e
f=atom/tuning/fusions.py
grep -q '^        out += ("w4_gate_up_silu",)$' $f
sed -i 's/^        out += ("w4_gate_up_silu",)$/        pass/' $f
! grep -q '"w4_gate_up_silu",)$' $f
