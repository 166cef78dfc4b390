set -e; f=atom/model_ops/kernels/fp8_gemv1.py
sed -i 's/^DEFAULT_TILE = (4, 128, 4, 2, True)$/DEFAULT_TILE = (4, 256, 8, 2, True)/; s/^TILES = {(6144, 4096): (8, 128, 4, 2, True)}$/TILES = {}/' $f
grep -q '^DEFAULT_TILE = (4, 256, 8, 2, True)$' $f && grep -q '^TILES = {}$' $f
