set -e; f=atom/model_ops/attention/triton_unified.py
sed -i 's/^    tile_n = 64 if head_pad <= 128 else 32$/    tile_n = 64 if head_pad <= 128 and max_query_len > 1 else 32/' $f
grep -q 'and max_query_len > 1 else 32' $f
