# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr` with VARIANTS=scripts/variants/fp8):
# "fp8_gate_up_silu" added to the default fusions: one-row ptpc fp8 gate-up stores silu(gate) up and its
# partial amaxes in its own launch (fp8_gemv1's GATED), without silu_amax's launch.
set -e
grep -q '^        out += ("w4_o_proj_add_norm",)$' atom/tuning/fusions.py
sed -i 's/^        out += ("w4_o_proj_add_norm",)$/        out += ("w4_o_proj_add_norm", "fp8_gate_up_silu")/' atom/tuning/fusions.py
grep -q 'out += ("w4_o_proj_add_norm", "fp8_gate_up_silu")' atom/tuning/fusions.py
