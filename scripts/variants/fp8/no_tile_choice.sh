# Variant (run inside a copy of the tree by `h200_lease.sh var` with VARIANTS=scripts/variants/fp8):
# no start-up choice of the one-row ptpc FP8 product's tile (`tuning.fp8_tile_choice`): every shape
# runs `fp8_gemv1.tile_for`'s table tile, as before the choice.
set -e
f=atom/model_engine/gpu_setup.py
[ "$(grep -c '^        fp8_tile_choice.choose_fp8_tiles(plan, runner.model)' $f)" = 1 ]
sed -i 's/^        fp8_tile_choice.choose_fp8_tiles(plan, runner.model)/        pass  # (variant: no fp8 tile choice)/' $f
! grep -q 'choose_fp8_tiles(plan' $f
