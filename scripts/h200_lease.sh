#!/usr/bin/env bash
# The H200 benchmarks of docs/perf in stages, for a lent machine that keeps /tmp between the
# calls of one lease. vLLM 0.26.0 (the peer) is too large for one call's transfer, so its
# pieces travel one per call and are gathered in /tmp/peer there.
#
# Here, once (the pieces plus the repository must stay under a call's 64 MiB):
#   bash ../shared/peer/fetch_vllm.sh && bash scripts/h200_lease.sh pack
#   (pack: .peer/q1..q5, ~45-52 MiB each; .srv: the wheels `vllm serve` and our server need beyond
#    vLLM's own list. For a before/after comparison put the `atom/` package of the engine to
#    compare with in .before/atom yourself, and name its commit in BEFORE)
# There, one call per piece, stages in order, e.g.
#   call 1 (carry .peer/q1):                 bash scripts/h200_lease.sh stash1 q_l0 q_l3
#   call 2 (carry .peer/q2):                 bash scripts/h200_lease.sh stash2 q_lat_l3 q_l0 q_l3
#   call 3 (carry .peer/q3 .before):         bash scripts/h200_lease.sh stash3 before q_before
#   call 4 (carry .peer/q4):                 bash scripts/h200_lease.sh stash4
#   call 5 (carry .peer/q5 .srv):            bash scripts/h200_lease.sh stash5 srv vllm serve
#   call 6:                                  bash scripts/h200_lease.sh q_vllm l_vllm
# Other stages: moe_k (the experts kernel at 1 / 64 / 2048 tokens), l_kv (Llama long-context
# workload, bf16 against FP8 KV), l_fp8 (Llama workload, bf16 against ptpc FP8), g_vllm
# (GPT-OSS-20B beside vLLM), w4_vllm / mx_vllm / fp8_vllm (Llama W4A16 / MXFP4 / ptpc FP8 batch-1 decode beside vLLM), moe_tests (the
# FP8 / MXFP4 / bf16 experts kernels' GPU tests), moe_k2 (the experts kernel at DeepSeek-V2-Lite's
# and GPT-OSS-20B's shapes), g_mx (GPT-OSS-20B with MXFP4 experts), moe_vllm / dsv2_vllm (Qwen3-30B-A3B /
# DeepSeek-V2-Lite beside vLLM, vLLM's dummies refilled with ATOM's rule), moe_lat / dsv2_lat (their decode
# ms/step at batch 1 / 8 / 64 beside vLLM), tune_dsv2 / tune_q3moe /
# tune_gptoss (a MoE shape's tiles into /tmp/res/tiles, ~150-280 s each), align (moe_align's two paths), moe_fp8_tests, prof_q (the kernels of 20
# Llama-3.1-8B batch-1 decode steps, bf16 and each quantized format), gate (DeepSeek's fp32 router
# GEMM two ways), mla (the MLA decode launch sweep with one block-table entry a token), new_tests
# (the GPU tests of the gate, MLA and MoE kernels), gated (the experts layer with SiLU-and-mul
# inside the first product against it as its own kernel, DeepSeek-V2-Lite's and Qwen3-30B-A3B's tiles),
# thr_moe (both MoE workloads, ATOM alone, with the split of the run into prompt and decode steps),
# prof_moe (the kernels of 10 decode steps from step 300 of each MoE workload, the first 90 in order),
# overlap (DeepSeek-V2-Lite's MoE block with the shared experts on a second stream against one),
# w4_dq (the 4-bit weight's write-out at Llama-3.1-8B's shapes, a grid of tiles, and the route at 128 rows),
# w4_sweep (the one-row 4-bit GEMV's tiles at Llama-3.1-8B's shapes, the formats in SWEEP_FORMATS), w4_opts
# (the table's tile with each of the sweep's OPTIONS: prefetches, pipelined loads, cache modifier), w4_opts_tests
# (their GPU tests: the same bits as the table's tile),
# w4_tests (the 4-bit kernels' GPU tests), fp8_accum (ptpc FP8 products at 128-1024 rows: cuBLASLt with and
# without fast accumulation, the Triton GEMM promoting its sums or not), fp8_sweep (one-row ptpc FP8: the swap-AB kernel against
# the bf16 GEMV reading fp8), fp8_h2 (one-row ptpc FP8: the swap-AB kernel against the CUDA-core
# product in fp16 pairs, `fp8_gemv1`'s tiles), h2_tests (that kernel's GPU tests, quantized dummy models in
# graphs, the fp8 cuBLASLt choice, the 8-bit fusions, the 4-bit weight written out, rows prepared for the
# 4-bit GEMV, the attention's in-kernel merge), xp_tests (only the last two: rows prepared for the 4-bit GEMV and
# the in-kernel merge), dn_tests (the GPU tests of "w4_down_add_norm": Llama's down then q/k/v, 4-bit
# engines with it; and of `w4_gemv1.EARLY_EPILOGUE`: the same bits; and of "w4_l2_next": the same bits, engines
# with it), w4_prep (the 4-bit GEMV reading prepared rows against
# preparing x itself, the producers, a batch-1 MLP both ways), w4_new (Llama-3.1-8B batch-1
# decode in W4A16, MXFP4 and bf16, ATOM alone), w4_before (the same 4-bit runs of the tree in .before,
# after the stage `before`), fz_add (batch-1 decode in FZ_FORMATS for each set in FZ_SETS, '|'-separated, of opt-in
# fusions added to the defaults in a copy of the tree, set i's files named fz<i>; beside `new` with AB_FORMATS the same), w4_prof (the kernels of 20 batch-1 decode steps in W4A16 and MXFP4, this
# tree and the one in .before), w4_unfused (the same 4-bit runs with "w4_norm_gemv" taken out of
# the default fusions, in a copy of the tree), w4_var (the same 4-bit runs, formats in VAR_FORMATS, for each
# .variants/NAME.py appended to w4_gemv1.py in a copy of the tree: tile-table variants, untracked files
# that travel with the working tree), var (the same for each .variants/NAME.sh run inside a copy
# of the tree; VAR_ONLY="a b": those names only), var_thr (those variants' Llama-3.1-8B workload, formats in VAR_FORMATS, VAR_ONLY too), new
# (batch-1 decode of the formats in AB_FORMATS, this tree only), ab (the same, this tree and
# .before's in turn, after the stage `before`), prof_nopdl (20 batch-1 decode steps' kernels of each format
# in PROF_FORMATS with PDL off in a copy of the tree: kernel times without overlapped waits), attn_tests
# (the attention kernels' GPU tests), act_tests (the GPU tests of the quantizing fusions, the 8-bit swap-AB
# product, rows quantized on load, the attention's amax and its summed q/k/v),
# w4_fsweep (that GEMV with the norm inside against the norm kernel and the GEMV, a few tiles), prof_fp8w (the kernels of 10 steps from step 300 of the Llama-3.1-8B
# workload, bf16 and ptpc FP8), fp8_gemm (ptpc FP8 products at 80-256 rows: torch._scaled_mm, the Triton
# GEMM and the swap-AB kernel), kv_tests (the FP8-KV attention and MLA decode tests,
# and the 4-bit kernels' GPU tests), attn_ahead (the unified attention's decode tilings with and
# without `rows_ahead`, Llama-3.1-8B shape), lt_tests (the start-up cuBLASLt choice's GPU tests, bf16 and
# row-wise fp8), lt_fp8 (row-wise FP8 products at 96-256 rows: torch._scaled_mm against cuBLASLt's candidates),
# fp8_thr_vllm (the Llama-3.1-8B workload in ptpc FP8 beside vLLM's, after the four stash calls, `srv` (vLLM's
# dependency wheels, carry .srv) and `vllm`),
# qdot_tma (the 8-bit swap-AB product with its weight tiles through TMA against pointer loads),
# attn_bs1 (the engine's batch-1 decode attention, rotary and merge inside, at 128-4096 tokens of context:
# its choice, the same with the opt-in skip_empty, and a grid of splits, TILE_N and warps, beside the KV read's
# time at HBM speed), attn_bs1_ahead (the same grid's tiles with `rows_ahead` at 3 stages, 4-64 splits, to 8192 tokens),
# attn_long (decode attention on the long-context workload's batches, bf16 and FP8 KV: the engine's choice against
# splits, tiles, stages and `rows_ahead`, beside the KV read's time at HBM speed; HBM_TBS sets that speed),
# var_prof (each variant's first 60 kernels of 20 batch-1 decode steps, PDL off: a layer's kernels in
# order, their times without overlapped waits; formats in VAR_FORMATS, VAR_ONLY too),
# var_kv (each variant's long-context workload, nano-vllm workload and batch-1 decode with an FP8 KV cache, bf16
# weights; scripts/variants/attn: fp8_tile64 / fp8_tile128 the FP8 decode tile at every batch size),
# merge_tests (the GPU tests of the in-kernel merge, skip_empty included),
# pw_tests (the GPU tests of MXFP4 pair words and CHAIN, the 4-bit kernels', and quantized dummy models
# started with CUDA graphs). VARIANTS names the
# folder of `var`'s / `var_thr`'s scripts (default .variants; tracked ones: scripts/variants/int4,
# scripts/variants/mxfp4, scripts/variants/fp8, scripts/variants/attn, scripts/variants/stream).
# Each stage's log and JSON land in /tmp/res; every call tars /tmp/res into $OUT/res.tgz.
# ATOM_BENCH_COMMIT names the commit in the JSON (the copied tree's .git can be stale).
set -u
if [ "${1:-}" = pack ]; then
  set -e
  rm -rf .peer/q1 .peer/q2 .peer/q3 .peer/q4 .peer/q5; mkdir -p .peer/q1 .peer/q2 .peer/q3 .peer/q4 .peer/q5 .srv .before
  (cd .peer/full && rm -f piece.* && split -b 50000000 -d slim.whl piece.)  # ~57 MB a call beside the ~9 MB tree
  mv .peer/full/piece.00 .peer/q1/; mv .peer/full/piece.01 .peer/q2/; mv .peer/full/piece.0[2-9] .peer/q3/
  cp .peer/p3/*.whl .peer/q4/; cp .peer/p4/*.whl .peer/q5/
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .srv \
    fastapi==0.135.0 starlette==1.0.1 watchfiles==1.3.0 model_hosting_container_standards==0.1.16 \
    jmespath==1.1.0 supervisor==4.3.0
  printf '/.srv/\n/.before/\n' >> .git/info/exclude
  du -sb .peer/q1 .peer/q2 .peer/q3 .peer/q4 .peer/q5 .srv .before
  exit 0
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
export ATOM_BENCH_COMMIT=${ATOM_BENCH_COMMIT:-unknown}
export PYTHONPATH=$PWD:/tmp/site
R=/tmp/res; B=/tmp/before; mkdir -p $R /tmp/peer
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
run() {  # name timeout_s command...: the command's output into $R/name.log, its end printed
  local name=$1 to=$2; shift 2
  log "start $name"
  timeout "$to" "$@" > "$R/$name.log" 2>&1; local rc=$?
  log "end $name rc=$rc"; tail -n 25 "$R/$name.log" | cut -c1-220
}
variant_tree() {  # script.sh: n=its name, /tmp/var-$n a copy of atom/ with the script run inside; fails
  n=$(basename $1 .sh); local va=$PWD/$1  # (the caller skips it) outside VAR_ONLY="a b" when set, or when the script fails
  [ -n "${VAR_ONLY:-}" ] && [[ " $VAR_ONLY " != *" $n "* ]] && return 1
  rm -rf /tmp/var-$n; mkdir -p /tmp/var-$n; cp -r atom /tmp/var-$n/
  (cd /tmp/var-$n && bash $va) || { log "variant $n failed"; return 1; }
}
tune() {  # experts width hidden top_k name: moe_tune's file, under a name that travels back (no '=' or ',')
  mkdir -p $R/tiles
  run moe-tune-$5 280 python3 -m atom.tuning.moe_tune --experts $1 --width $2 --hidden $3 --top-k $4 --space quick \
    --tokens 1,2,4,8,16,32,48,64,96,128,192,256,384,512,2048,8192 --out /tmp/tiles
  local f=(/tmp/tiles/E=$1,I=$2,H=$3,*.json)
  if [ -f "${f[0]}" ]; then cp "${f[0]}" $R/tiles/$5.json; else log "moe_tune wrote no file for $5"; fi
}
# the commit compared with runs from its own tree: `python -m` puts the working directory first
# on sys.path, so it must be the before tree's, not this checkout's
before=(env -C $B PYTHONPATH=$B:/tmp/site ATOM_BENCH_COMMIT="${BEFORE:-before}")
Q="--model qwen3-0.6b"; L="--model llama-3.1-8b"; LAT="--modes graphs --new-tokens 256"
for st in "$@"; do ts=$(date +%s); case $st in
  stash[1-5]) cp .peer/q${st#stash}/* /tmp/peer/; log "stashed ${st#stash}: $(ls /tmp/peer | wc -l) files";;
  before) rm -rf $B; mkdir -p $B; cp -r .before/atom $B/; log "before tree at $B";;
  srv) (cd /tmp/peer && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
         $(ls *.whl | grep -v -E '^(fastapi|starlette|xgrammar)-')) &&
       python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .srv/*.whl
       log "srv rc=$?";;
  vllm) (cd /tmp/peer && cat piece.0* > vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl && rm -f piece.0* &&
         python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
           vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl xgrammar-*.whl)
        log "vllm rc=$? $(python3 -c 'import vllm.entrypoints.openai.api_server, vllm; print(vllm.__version__)' 2>&1 | tail -1)";;
  tests) G=tests/test_gpu_engine.py; LV=$G::test_levels_and_graph_modes_match_transformers; F=$G::test_fp32_greedy_equals_transformers
         run gpu-tests 300 python3 -m pytest -q -p no:cacheprovider -rA "$F[qwen3-graphs]" "$F[qwen3-preemption_graphs]" \
           "$LV[qwen3-0-FULL]" "$LV[qwen3-3-TR_HYBRID]" "$LV[qwen3-3-FULL]" "$F[llama-graphs]" "$LV[llama-0-TR_HYBRID]";;
  q_l0) run q-thr-l0-$ts 200 python3 -m atom.benchmarks.throughput $Q --peer none --repeat 1 --level 0 --out $R/q-thr-l0-$ts.json;;
  q_l3) run q-thr-l3-$ts 400 python3 -m atom.benchmarks.throughput $Q --peer none --repeat 1 --level 3 --out $R/q-thr-l3-$ts.json;;
  q_lat_l3) run q-lat-l3 300 python3 -m atom.benchmarks.latency $Q $LAT --level 3 --out $R/q-lat-l3.json;;
  q_before) run q-thr-before 200 "${before[@]}" python3 -m atom.benchmarks.throughput $Q --peer none --repeat 1 --cache-dir /tmp/bc --out $R/q-thr-before.json
            run q-lat-before 200 "${before[@]}" python3 -m atom.benchmarks.latency $Q $LAT --cache-dir /tmp/bc --out $R/q-lat-before.json;;
  l_before) run l-thr-before 300 "${before[@]}" python3 -m atom.benchmarks.throughput $L --peer none --repeat 1 --cache-dir /tmp/lc --out $R/l-thr-before.json
            run l-lat-before 200 "${before[@]}" python3 -m atom.benchmarks.latency $L $LAT --cache-dir /tmp/lc --out $R/l-lat-before.json;;
  serve) run serve-$ts 560 python3 -m atom.benchmarks.serving_compare $Q --servers atom vllm --request-rate 4 16 64 inf \
           --num-prompts 200 --input-len 512 --output-len 128 --log-dir $R/serve-logs-$ts --out $R/serve-$ts.json;;
  q_vllm) run q-thr-vllm 300 python3 -m atom.benchmarks.throughput $Q --peer vllm --repeat 1 --out $R/q-thr-vllm.json
          run q-lat-vllm 240 python3 -m atom.benchmarks.latency $Q $LAT --peer vllm --repeat 1 --out $R/q-lat-vllm.json;;
  l_vllm) run l-thr-vllm 300 python3 -m atom.benchmarks.throughput $L --peer vllm --repeat 1 --cache-dir /tmp/gc --out $R/l-thr-vllm.json
          run l-lat-vllm 240 python3 -m atom.benchmarks.latency $L $LAT --peer vllm --repeat 1 --cache-dir /tmp/gc --out $R/l-lat-vllm.json;;
  moe_k) run moe-q3 150 python3 -m atom.benchmarks.moe_experts --model qwen3-30b-a3b --out $R/moe-q3.json
         run moe-dsv2 150 python3 -m atom.benchmarks.moe_experts --model deepseek-v2-lite --out $R/moe-dsv2.json;;
  l_kv) run l-long-bf16 300 python3 -m atom.benchmarks.throughput $L --peer none --repeat 1 --workload long --cache-dir /tmp/lc --out $R/l-long-bf16.json
        run l-long-fp8 300 python3 -m atom.benchmarks.throughput $L --peer none --repeat 1 --workload long --kv-cache-dtype fp8 --cache-dir /tmp/lc --out $R/l-long-fp8.json;;
  l_fp8) run l-thr-bf16 300 python3 -m atom.benchmarks.throughput $L --peer none --repeat 1 --cache-dir /tmp/lc --out $R/l-thr-bf16.json
         run l-thr-fp8 420 python3 -m atom.benchmarks.throughput $L --peer none --repeat 1 --quantization fp8_dynamic --cache-dir /tmp/lc --out $R/l-thr-fp8.json;;
  g_vllm) run g-thr-vllm 420 python3 -m atom.benchmarks.throughput --model gpt-oss-20b --peer vllm --peer-dummy xavier --repeat 1 --out $R/g-thr-vllm.json;;
  w4_vllm) run l-lat-w4-vllm 300 python3 -m atom.benchmarks.latency $L $LAT --batches 1 --peer vllm --repeat 1 --quantization w4a16 --cache-dir /tmp/lc --out $R/l-lat-w4-vllm.json;;
  mx_vllm) run l-lat-mx-vllm 300 python3 -m atom.benchmarks.latency $L $LAT --batches 1 --peer vllm --repeat 1 --quantization mxfp4_w4a16 --cache-dir /tmp/lc --out $R/l-lat-mx-vllm.json;;
  fp8_thr_vllm) run l-thr-fp8-vllm 560 python3 -m atom.benchmarks.throughput $L --peer vllm --repeat 1 --quantization fp8_dynamic \
                  --cache-dir /tmp/lc --out $R/l-thr-fp8-vllm.json;;
  fp8_vllm) run l-lat-fp8-vllm 300 python3 -m atom.benchmarks.latency $L $LAT --batches 1 --peer vllm --repeat 1 --quantization fp8_dynamic --cache-dir /tmp/lc --out $R/l-lat-fp8-vllm.json;;
  moe_tests) run moe-gpu-tests 300 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_moe_topk_sum.py tests/test_moe_fp8_triton.py \
               tests/test_moe_mxfp4_triton.py tests/test_moe_kernels.py;;
  moe_k2) run moe-dsv2 150 python3 -m atom.benchmarks.moe_experts --model deepseek-v2-lite --out $R/moe-dsv2.json
          run moe-gptoss 150 python3 -m atom.benchmarks.moe_experts --model gpt-oss-20b --out $R/moe-gptoss.json;;
  g_mx) run g-mx-thr 400 python3 -m atom.benchmarks.throughput --model gpt-oss-20b-mxfp4 --peer none --repeat 1 --out $R/g-mx-thr.json;;
  moe_vllm) run q3moe-thr-vllm 420 python3 -m atom.benchmarks.throughput --model qwen3-30b-a3b --peer vllm --peer-dummy xavier --repeat 1 --out $R/q3moe-thr-vllm.json;;
  dsv2_vllm) run dsv2-thr-vllm 420 python3 -m atom.benchmarks.throughput --model deepseek-v2-lite --peer vllm --peer-dummy xavier --repeat 1 --out $R/dsv2-thr-vllm.json;;
  moe_lat) run q3moe-lat-vllm 420 python3 -m atom.benchmarks.latency --model qwen3-30b-a3b $LAT --batches 1 8 64 --peer vllm \
             --peer-dummy xavier --repeat 1 --out $R/q3moe-lat-vllm.json;;
  dsv2_lat) run dsv2-lat-vllm 420 python3 -m atom.benchmarks.latency --model deepseek-v2-lite $LAT --batches 1 8 64 --peer vllm \
             --peer-dummy xavier --repeat 1 --out $R/dsv2-lat-vllm.json;;
  thr_moe) for m in deepseek-v2-lite qwen3-30b-a3b; do
             run $m-thr 240 python3 -m atom.benchmarks.throughput --model $m --peer none --repeat 1 --out $R/$m-thr.json
           done;;
  prof_moe) for m in qwen3-30b-a3b deepseek-v2-lite; do
              run prof-$m 200 python3 scripts/gpu_profile.py --model $m --no-summary --windows 300:10 --sequence 90
            done;;
  new_tests2) run new-gpu-tests2 240 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_gpu_moe_engine.py tests/test_moe_kernels.py \
                tests/test_moe_shared_overlap.py tests/test_host_copy.py;;
  overlap) run moe-shared-overlap 150 python3 scripts/moe_shared_overlap.py --tokens 1 64 200 2048 --out $R/moe-shared-overlap.json;;
  gate) run fp32-gate-sweep 150 python3 scripts/fp32_gate_sweep.py --out $R/fp32-gate-sweep.json;;
  mla) run mla-sweep 400 python3 scripts/mla_decode_sweep.py --token-rows --batches 1 8 32 64 128 200 256 --contexts 1024 \
         --out $R/mla-sweep.json;;
  attn_ahead) run attn-rows-ahead 300 python3 scripts/attention_sweep.py --out $R/attn-rows-ahead.json --decode-only \
                --rows-ahead --decode-tilings 64/2/4 64/3/4 64/4/4 32/3/4 32/4/4;;
  new_tests) run new-gpu-tests 300 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_fp32_gate.py \
               tests/test_mla_decode_knobs.py tests/test_mla.py tests/test_moe_kernels.py tests/test_moe_topk_sum.py \
               tests/test_moe_shared_stack.py tests/test_moe_route_triton.py tests/test_gpu_moe_engine.py \
               tests/test_moe_shared_overlap.py tests/test_host_copy.py;;
  gated) D=atom/model_ops/moe/configs
         run moe-gated-dsv2 150 python3 scripts/moe_tiles_compare.py --old "$D/E=64,I=1408,H=2048,dtype=bfloat16,device=NVIDIA_H200.json" \
           --new "$D/E=64,I=1408,H=2048,dtype=bfloat16,device=NVIDIA_H200.json" --top-k 6 --old-unfused \
           --tokens 1 8 64 200 2048 --out $R/moe-gated-dsv2.json
         run moe-gated-q3 150 python3 scripts/moe_tiles_compare.py --old "$D/E=128,I=768,H=2048,dtype=bfloat16,device=NVIDIA_H200.json" \
           --new "$D/E=128,I=768,H=2048,dtype=bfloat16,device=NVIDIA_H200.json" --top-k 8 --old-unfused \
           --tokens 1 8 64 200 2048 --out $R/moe-gated-q3.json;;
  align) run moe-align-sweep 120 python3 scripts/moe_align_sweep.py --out $R/moe-align-sweep.json;;
  tune_dsv2) tune 64 1408 2048 6 dsv2;;
  tune_q3moe) tune 128 768 2048 8 q3moe;;
  tune_gptoss) tune 32 2880 2880 4 gptoss;;
  moe_fp8_tests) run moe-fp8-gpu-tests 200 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_moe_fp8_triton.py;;
  kv_tests) run kv-gpu-tests 150 python3 -m pytest -q -p no:cacheprovider -rA tests/test_gpu_attention_fp8.py \
              tests/test_mla_decode_knobs.py
            run w4-gpu-tests 150 python3 -m pytest -q -p no:cacheprovider -rA tests/test_quant_kernels_4bit.py -m gpu;;
  w4_sweep) run w4-gemv1-sweep 560 python3 scripts/w4_gemv1_sweep.py --formats ${SWEEP_FORMATS:-int4 mxfp4} --out $R/w4-gemv1-sweep.json;;
  w4_opts) run w4-gemv1-options 540 python3 scripts/w4_gemv1_sweep.py --options --formats ${SWEEP_FORMATS:-int4 mxfp4} \
             --out $R/w4-gemv1-options.json;;
  w4_opts_tests) run w4-options-gpu-tests 400 python3 -m pytest -q -p no:cacheprovider -rA -m gpu \
                   tests/test_quant_kernels_4bit.py -k pipelined_and_prefetching;;
  fp8_gemm) run fp8-gemm-sweep 400 python3 scripts/fp8_gemm_sweep.py --out $R/fp8-gemm-sweep.json;;
  lt_tests) run lt-gpu-tests 240 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_gemm_tuning.py \
              tests/test_gemm_tuning_fp8.py;;
  lt_fp8) run lt-fp8-probe 400 python3 scripts/cublaslt_probe.py --dtype fp8 --rows 96 160 192 256 --deadline 330 \
            --shapes qkv o gate_up down \
            --out $R/lt-fp8-probe.json;;
  fp8_accum) run fp8-accum-probe 400 python3 scripts/fp8_accum_probe.py --out $R/fp8-accum-probe.json;;
  qdot_tma) run qdot-tma-sweep 200 python3 scripts/qdot_tma_sweep.py --deadline ${SWEEP_DEADLINE:-120} --out $R/qdot-tma-sweep.json;;
  fp8_sweep) run fp8-gemv-sweep 200 python3 scripts/fp8_gemv_sweep.py --out $R/fp8-gemv-sweep.json;;
  fp8_h2) run fp8-h2-probe 240 python3 scripts/fp8_h2_probe.py --out $R/fp8-h2-probe.json;;
  attn_bs1) run attn-bs1 400 python3 scripts/attention_bs1_sweep.py --out $R/attn-bs1.json;;
  attn_long) run attn-long 500 python3 scripts/attention_long_sweep.py --out $R/attn-long.json --hbm-tbs ${HBM_TBS:-4.8};;
  merge_tests) run merge-gpu-tests 300 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_attention_split_merge.py;;
  attn_bs1_ahead) run attn-bs1-ahead 400 python3 scripts/attention_bs1_sweep.py --out $R/attn-bs1-ahead.json --ahead \
                    --stages 3 --splits 4 8 16 32 64 --tiles 32 64 --warps 4 --contexts 256 1024 4096 8192;;
  h2_tests) run h2-gpu-tests 420 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_fp8_gemv1.py \
              tests/test_gpu_quant_engine.py tests/test_gemm_tuning_fp8.py tests/test_quant_fusions.py \
              tests/test_act_quant_fused.py tests/test_w4_dequant.py tests/test_h2_xpack.py \
              tests/test_attention_split_merge.py;;
  xp_tests) run xp-gpu-tests 400 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_h2_xpack.py \
              tests/test_attention_split_merge.py;;
  dn_tests) run dn-gpu-tests 360 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_w4_down_add_norm.py \
              tests/test_w4_l2_next.py tests/test_h2_xpack.py -k "down or early or l2";;
  w4_dq) run w4-dequant-probe 300 python3 scripts/w4_dequant_probe.py --out $R/w4-dequant-probe.json;;
  w4_prep) run w4-prepared-sweep 400 python3 scripts/w4_prepared_sweep.py --out $R/w4-prepared-sweep.json;;
  w4_fsweep) run w4-fused-sweep 400 python3 scripts/w4_fused_sweep.py --out $R/w4-fused-sweep.json;;
  w4_tests) run w4-gpu-tests 200 python3 -m pytest -q -p no:cacheprovider -rA tests/test_quant_kernels_4bit.py -m gpu;;
  pw_tests) run pw-gpu-tests 420 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_fp4_pair_words.py \
              tests/test_quant_kernels_4bit.py tests/test_gpu_quant_engine.py;;
  w4_new) for f in w4a16 mxfp4_w4a16 bf16; do
            q=(--quantization $f); [ $f = bf16 ] && q=()
            run l-lat1-$f 150 python3 -m atom.benchmarks.latency $L $LAT --batches 1 --peer none --repeat 1 "${q[@]}" \
              --cache-dir /tmp/lc --out $R/l-lat1-$f.json
          done;;
  w4_before) for f in w4a16 mxfp4_w4a16; do  # after the stage `before`: the 4-bit runs of the tree in .before
              run l-lat1-before-$f 150 "${before[@]}" python3 -m atom.benchmarks.latency $L $LAT --batches 1 --peer none \
                --repeat 1 --quantization $f --cache-dir /tmp/bc --out $R/l-lat1-before-$f.json
            done;;
  w4_prof) for f in w4a16 mxfp4_w4a16; do  # after the stage `before`: 20 batch-1 decode steps' kernels, this tree and .before's
            run prof-bs1-$f 150 python3 scripts/gpu_profile.py $L --scenario bs1 --quantization $f --no-summary --windows 100:20 --sequence 40
            run prof-bs1-before-$f 150 "${before[@]}" python3 $PWD/scripts/gpu_profile.py $L --scenario bs1 --quantization $f \
              --no-summary --windows 100:20 --sequence 40
          done;;
  w4_unfused) rm -rf /tmp/nofz; mkdir -p /tmp/nofz; cp -r atom /tmp/nofz/  # the tree without "w4_norm_gemv" by default
            sed -i 's/("norm+quant", "silu+quant", "w4_norm_gemv")/("norm+quant", "silu+quant")/' /tmp/nofz/atom/tuning/fusions.py
            if ! grep -q 'out += ("norm+quant", "silu+quant")$' /tmp/nofz/atom/tuning/fusions.py; then
              log "w4_unfused: the sed missed default_fusions"
            else for f in w4a16 mxfp4_w4a16; do
              run l-lat1-nofz-$f 150 env -C /tmp/nofz PYTHONPATH=/tmp/nofz:/tmp/site python3 -m atom.benchmarks.latency $L $LAT \
                --batches 1 --peer none --repeat 1 --quantization $f --cache-dir /tmp/lc --out $R/l-lat1-nofz-$f.json
            done; fi;;
  fz_add) i=0; IFS='|' read -ra sets <<< "${FZ_SETS:-sum+norm+quant|quant_on_load|sum+norm+quant quant_on_load|sum+norm+quant quant_on_load qkv_sum_in_attention|split_k_fold}"
          for set in "${sets[@]}"; do  # each set of opt-in fusions added to the defaults in a copy of the tree
            i=$((i+1)); rm -rf /tmp/fz$i; mkdir -p /tmp/fz$i; cp -r atom /tmp/fz$i/
            add=$(printf ', "%s"' $set)
            sed -i "s/out += (\"norm+quant\", \"silu+quant\", \"w4_norm_gemv\")\$/out += (\"norm+quant\", \"silu+quant\", \"w4_norm_gemv\"$add)/" \
              /tmp/fz$i/atom/tuning/fusions.py
            if ! grep -qF "\"w4_norm_gemv\"$add)" /tmp/fz$i/atom/tuning/fusions.py; then log "fz_add: the sed missed default_fusions ($set)"; continue; fi
            log "fz_add set $i: $set"
            for f in ${FZ_FORMATS:-fp8_dynamic}; do  # batch-1 decode; `new` with the same AB_FORMATS is the tree without
              run l-lat1-fz$i-$f 150 env -C /tmp/fz$i PYTHONPATH=/tmp/fz$i:/tmp/site python3 -m atom.benchmarks.latency $L $LAT \
                --batches 1 --peer none --repeat 1 --quantization $f --cache-dir /tmp/lc --out $R/l-lat1-fz$i-$f.json
            done
          done;;
  ab) for f in ${AB_FORMATS:-bf16 w4a16}; do  # after the stage `before`: batch-1 decode, this tree and .before's in turn
        q=(--quantization $f); [ $f = bf16 ] && q=()
        run l-lat1-$f 150 python3 -m atom.benchmarks.latency $L $LAT --batches 1 --peer none --repeat 1 "${q[@]}" \
          --cache-dir /tmp/lc --out $R/l-lat1-$f.json
        run l-lat1-before-$f 150 "${before[@]}" python3 -m atom.benchmarks.latency $L $LAT --batches 1 --peer none \
          --repeat 1 "${q[@]}" --cache-dir /tmp/bc --out $R/l-lat1-before-$f.json
      done;;
  act_tests) run act-gpu-tests 300 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_act_quant_fused.py \
               tests/test_quant_fusions.py tests/test_quant_gemv_dot.py tests/test_triton_kernels.py::test_attention_stores_each_heads_amax \
               tests/test_attention_rope.py::test_decode_rope_sums_split_qkv_on_load_gpu;;
  attn_tests) run attn-gpu-tests 540 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_attention_split_merge.py \
                tests/test_gpu_attention_fp8.py tests/test_triton_kernels.py -k "attention or attn or merge";;
  w4_var) for v in .variants/*.py; do  # each variant file appended to a copy's w4_gemv1.py (e.g. table edits), 4-bit decode
            n=$(basename $v .py); rm -rf /tmp/var-$n; mkdir -p /tmp/var-$n; cp -r atom /tmp/var-$n/
            cat $v >> /tmp/var-$n/atom/model_ops/kernels/w4_gemv1.py
            for f in ${VAR_FORMATS:-w4a16 mxfp4_w4a16}; do
              run l-lat1-var$n-$f 150 env -C /tmp/var-$n PYTHONPATH=/tmp/var-$n:/tmp/site python3 -m atom.benchmarks.latency \
                $L $LAT --batches 1 --peer none --repeat 1 --quantization $f --cache-dir /tmp/lc --out $R/l-lat1-var$n-$f.json
            done
          done;;
  var) for v in ${VARIANTS:-.variants}/*.sh; do  # each variant script run inside a copy of the tree (e.g. a sed of a constant), batch-1 decode
        variant_tree $v || continue
        for f in ${VAR_FORMATS:-w4a16 mxfp4_w4a16}; do
          q=(--quantization $f); [ $f = bf16 ] && q=()
          run l-lat1-var$n-$f 150 env -C /tmp/var-$n PYTHONPATH=/tmp/var-$n:/tmp/site python3 -m atom.benchmarks.latency \
            $L $LAT --batches 1 --peer none --repeat 1 "${q[@]}" --cache-dir /tmp/lc --out $R/l-lat1-var$n-$f.json
        done
      done;;
  var_thr) for v in ${VARIANTS:-.variants}/*.sh; do  # the same variants, the Llama-3.1-8B workload in VAR_FORMATS
        variant_tree $v || continue
        for f in ${VAR_FORMATS:-fp8_dynamic}; do
          run l-thr-var$n-$f 300 env -C /tmp/var-$n PYTHONPATH=/tmp/var-$n:/tmp/site python3 -m atom.benchmarks.throughput \
            $L --peer none --repeat 1 --quantization $f --cache-dir /tmp/lc --out $R/l-thr-var$n-$f.json
        done
      done;;
  var_kv) for v in ${VARIANTS:-.variants}/*.sh; do  # the same variants with an FP8 KV cache: the long-context
        variant_tree $v || continue                    # workload, the nano-vllm one and batch-1 decode, bf16 weights
        run l-long-var$n-kvfp8 300 env -C /tmp/var-$n PYTHONPATH=/tmp/var-$n:/tmp/site python3 -m atom.benchmarks.throughput \
          $L --peer none --repeat 1 --workload long --kv-cache-dtype fp8 --cache-dir /tmp/lc --out $R/l-long-var$n-kvfp8.json
        run l-thr-var$n-kvfp8 300 env -C /tmp/var-$n PYTHONPATH=/tmp/var-$n:/tmp/site python3 -m atom.benchmarks.throughput \
          $L --peer none --repeat 1 --kv-cache-dtype fp8 --cache-dir /tmp/lc --out $R/l-thr-var$n-kvfp8.json
        run l-lat1-var$n-kvfp8 200 env -C /tmp/var-$n PYTHONPATH=/tmp/var-$n:/tmp/site python3 -m atom.benchmarks.latency \
          $L $LAT --batches 1 --peer none --repeat 1 --kv-cache-dtype fp8 --cache-dir /tmp/lc --out $R/l-lat1-var$n-kvfp8.json
      done;;
  var_prof) for v in ${VARIANTS:-.variants}/*.sh; do  # each variant's kernels of 20 batch-1 decode steps in order, PDL off
        variant_tree $v || continue
        sed -i 's/^USE_PDL = True$/USE_PDL = False/' /tmp/var-$n/atom/model_ops/kernels/triton_import.py
        if ! grep -q '^USE_PDL = False$' /tmp/var-$n/atom/model_ops/kernels/triton_import.py; then log "var_prof: the sed missed USE_PDL"; continue; fi
        for f in ${VAR_FORMATS:-w4a16}; do
          run prof-nopdl-seq-$n-$f 150 env -C /tmp/var-$n PYTHONPATH=/tmp/var-$n:/tmp/site python3 $PWD/scripts/gpu_profile.py \
            $L --scenario bs1 --quantization $f --no-summary --windows 100:20 --sequence 60
        done
      done;;
  new) for f in ${AB_FORMATS:-bf16 w4a16}; do  # batch-1 decode of this tree only
        q=(--quantization $f); [ $f = bf16 ] && q=()
        run l-lat1-$f 150 python3 -m atom.benchmarks.latency $L $LAT --batches 1 --peer none --repeat 1 "${q[@]}" \
          --cache-dir /tmp/lc --out $R/l-lat1-$f.json
      done;;
  prof_nopdl) rm -rf /tmp/nopdl; mkdir -p /tmp/nopdl; cp -r atom /tmp/nopdl/  # kernel times without PDL's overlapped waits
            sed -i 's/^USE_PDL = True$/USE_PDL = False/' /tmp/nopdl/atom/model_ops/kernels/triton_import.py
            if ! grep -q '^USE_PDL = False$' /tmp/nopdl/atom/model_ops/kernels/triton_import.py; then log "prof_nopdl: the sed missed USE_PDL"
            else for f in ${PROF_FORMATS:-bf16 fp8_dynamic w4a16 mxfp4_w4a16}; do
              run prof-nopdl-bs1-$f 150 env -C /tmp/nopdl PYTHONPATH=/tmp/nopdl:/tmp/site python3 $PWD/scripts/gpu_profile.py $L \
                --scenario bs1 --quantization $f --no-summary --windows 100:20
            done; fi;;
  prof_fp8w) for f in bf16 fp8_dynamic; do
              run prof-wl-$f 200 python3 scripts/gpu_profile.py $L --quantization $f --no-summary --windows 300:10
            done;;
  prof_q) for f in bf16 fp8_dynamic w4a16 mxfp4_w4a16; do
            run prof-bs1-$f 150 python3 scripts/gpu_profile.py $L --scenario bs1 --quantization $f --no-summary --windows 100:20
          done;;
  *) log "unknown stage $st";;
esac
tar -czf "$OUT/res.tgz" -C /tmp res 2>/dev/null  # after every stage: a call cut off keeps what ran
done
nvidia-smi --query-gpu=uuid,clocks.sm,temperature.gpu --format=csv,noheader > $R/gpu.txt 2>&1
tar -czf "$OUT/res.tgz" -C /tmp res 2>/dev/null; log "done"
