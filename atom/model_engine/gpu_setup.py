"""GPU set-up of a ModelRunner: the attention op, compilation level, CUDA graphs.

Compilation (`CompilationConfig.level`, skipped under `enforce_eager`):
  0 eager; 1 `torch.compile` as is; 2 compiled once with dynamic token counts;
  3 piecewise: compiled with dynamic token counts, the attention custom op
  (`atom::unified_attention_with_output`, our name for the guide's
  `aiter.unified_attention_with_output` splitting op) left opaque so the graph is split
  there and Inductor fuses what lies between.
CUDA graphs (`cudagraph_mode`, `use_cudagraph`, capture sizes): decode batches replay a
full-forward graph per capture size in every mode but NONE. Steps with prefill tokens replay
a graph per (tokens, sequences) bucket (`mixed_graphs`, up to 2048 tokens) where the mode's
mixed half is FULL or TR_HYBRID (FULL, TR_HYBRID: the default at level 3, FULL_AND_TR_HYBRID),
on the Triton attention backend of one rank; otherwise, and past the largest bucket, they
run without a graph. An unset mode means FULL_AND_TR_HYBRID at level 0 and FULL_DECODE_ONLY
at levels 1-2.
At level 3 the decode graphs are captured from the model with the kernel plan's fusions
(one-row GEMVs with the norm / SiLU / rotary folded in, the rotary folded into decode
attention, the chosen cuBLASLt algorithms), which one-token steps run faster than the
kernels Inductor generates; prefill and mixed steps run the piecewise-compiled model,
compiled once at start-up on a dummy prefill.
Linear layers: cuBLAS / hipBLASLt through `F.linear`, or the Triton GEMM where
`ATOM_USE_TRITON_GEMM=1` (read here, once per engine, into its kernel plan). With CUDA graphs
at level 0 and the Triton attention backend the start-up also chooses the Triton GEMV for
batch-1 shapes (`tuning.gemv_choice`) and, without the Triton GEMM, on NVIDIA GPUs, a cuBLASLt
algorithm for the other capture sizes and for a full prefill step's `max_num_batched_tokens`
rows (`tuning.gemm_choice`); all of it goes into the runner's `KernelPlan`.
"""
from __future__ import annotations

import logging
import time

import torch

from atom.config import CUDAGraphMode

logger = logging.getLogger(__name__)


def effective_graph_mode(config) -> CUDAGraphMode:
    cc = config.compilation_config
    if config.enforce_eager or not cc.use_cudagraph or not config.capture_sizes:
        return CUDAGraphMode.NONE
    if cc.cudagraph_mode is not None:
        return cc.cudagraph_mode
    # unset: level 0 records decode graphs and token graphs for steps with prefill tokens
    # (host-bound below a few thousand tokens); levels 1-2 decode graphs only
    return CUDAGraphMode.FULL_AND_TR_HYBRID if cc.level == 0 else CUDAGraphMode.FULL_DECODE_ONLY


def compile_model(runner) -> None:
    config = runner.config
    level = 0 if config.enforce_eager else config.compilation_config.level
    runner.compile_level = level
    if level == 0:
        return
    cc = config.compilation_config
    backend = "inductor" if cc.use_inductor else "eager"
    options = dict(cc.inductor_compile_config) if backend == "inductor" and cc.inductor_compile_config else None
    dynamic = None if level == 1 else True
    # level 3 is one graph, except across ranks: the collectives (compiler-disabled calls)
    # split it there, so that tensor-parallel engines compile too
    ranks = getattr(runner, "parallel", None)
    fullgraph = level == 3 and (ranks is None or ranks.world_size == 1)
    runner.model_forward = torch.compile(runner.model, backend=backend, dynamic=dynamic, options=options,
                                         fullgraph=fullgraph)
    runner.decode_forward = runner.model if level == 3 else runner.model_forward
    logger.info("compilation level %d (backend %s, dynamic=%s)", level, backend, dynamic)


def warm_up_compiled(runner, num_tokens: int = 32) -> None:
    """Compile now, on a dummy prefill of `num_tokens` tokens into the first blocks (free
    until a request takes them, which overwrites them), not in the first request's step."""
    t0 = time.perf_counter()
    seqs, _ = runner.dummy_prefills([min(num_tokens, runner.num_blocks * runner.block_size)])
    with torch.inference_mode():
        runner.dummy_forward(seqs)
    torch.cuda.synchronize(runner.device)
    logger.info("compiled the model (level %d) in %.1f s", runner.compile_level, time.perf_counter() - t0)


def host_syncing_layers(runner) -> list[tuple[str, str]]:
    """(layer, method) of every MoE layer whose kernel on this device syncs the host."""
    from atom.model_ops.moe import MoEMethod
    return [(name, repr(m.method)) for name, m in runner.model.named_modules()
            if isinstance(getattr(m, "method", None), MoEMethod) and m.method.syncs_host(m, runner.device)]


def setup(runner) -> None:
    """Compilation, GEMM / GEMV choices and CUDA graphs for this engine, then the eager
    steps' kernels warmed (`warm_up_eager_steps`)."""
    _setup_graphs(runner)
    warm_up_eager_steps(runner)


def eager_step_shapes(max_tokens: int, max_model_len: int, past_graphs: int) -> list[list[tuple[int, int]]]:
    """The warm-up batches of `warm_up_eager_steps`: per batch, (context, new tokens) per
    sequence. Each holds more than `past_graphs` tokens (so that no mixed-step graph takes
    it) and at most `max_tokens`; none has a sequence past `max_model_len`. One batch has
    odd counts everywhere (decode rows, a chunk after an odd context, a fresh prompt; an odd
    total), one has counts that are multiples of 16, and one is a single fresh prompt: the
    integer arguments a Triton kernel specializes on (== 1, divisible by 16, neither) take
    each kind at least once. Empty when such a step cannot exist."""
    total = min(max_tokens, max(past_graphs + 17, 257))
    if total <= past_graphs or total < 64:
        return []
    odd = [(37, 1), (101, 1), (9, 1), (53, 211)]
    odd_total = total if total % 2 else total - 1
    aligned_total = total - total % 16
    out = []
    rest = odd_total - sum(n for _, n in odd)
    if odd_total > past_graphs and 0 < rest <= max_model_len and all(c + n <= max_model_len for c, n in odd):
        out.append(odd + [(0, rest)])
    rest = aligned_total - 128
    if aligned_total > past_graphs and 0 < rest <= max_model_len and 64 + 128 <= max_model_len:
        out.append([(64, 128), (0, rest)])
    if total <= max_model_len:
        out.append([(0, total)])
    return out


def warm_up_eager_steps(runner) -> list[list[tuple[int, int]]]:
    """Run a few steps that neither the decode nor the mixed-step CUDA graphs take, eagerly,
    at start-up (`eager_step_shapes`: decode rows, a chunk after its context and fresh
    prompts together, past the largest mixed-step graph), sampling included, on blocks no
    request holds yet.

    Why: a Triton kernel is compiled per specialization of its integer arguments (== 1,
    divisible by 16, other) and per constexpr path, so the first step of an unseen kind
    (a prefill chunk after its context, an odd token count past the graphs' buckets)
    compiled kernels while requests waited, more than a second with a cold cache: a server
    hit by a burst of requests showed it in their time to first token. Returns the batches
    it ran (none under tensor / data parallel, where every rank would have to step)."""
    from atom.model_engine.sequence import Sequence
    from atom.sampling_params import SamplingParams
    if runner.parallel.world_size > 1 or runner.parallel.moe_group is not None:
        return []
    config = runner.config
    mixed = runner.mixed_graphs
    past = mixed.max_tokens if mixed is not None else 0
    batches = eager_step_shapes(config.max_num_batched_tokens, config.max_model_len, past)
    bs = runner.block_size
    t0 = time.perf_counter()
    ran = []
    for i, batch in enumerate(batches):
        seqs, next_block = [], 0
        for c, n in batch:
            params = SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=1)
            s = Sequence([0] * (c + n), params)  # token 0: in every vocabulary
            s.num_computed_tokens = c
            s.num_new_tokens = n
            s.block_table = list(range(next_block, next_block + -(-(c + n) // bs)))
            next_block += len(s.block_table)
            seqs.append(s)
        if next_block > runner.num_blocks:
            continue
        runner.run(seqs)
        ran.append(batch)
    if ran:
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        logger.info("warmed %d eager step kind(s) past the CUDA graphs in %.1f s", len(ran), time.perf_counter() - t0)
    return ran


def _setup_graphs(runner) -> None:
    from atom.model_engine.cuda_graphs import CUDAGraphRunner
    from atom.model_engine.mixed_graphs import MixedGraphRunner, token_buckets
    from atom.tuning import fp8_tile_choice, gemm_choice, gemv_choice
    from atom.utils import envs
    config = runner.config
    plan = runner.plan
    triton_gemm = bool(envs.ATOM_USE_TRITON_GEMM) and runner.attn_backend.name == "triton"
    plan.triton_gemm = triton_gemm
    logger.info("linear layers: %s", "Triton GEMM (ATOM_USE_TRITON_GEMM=1)" if triton_gemm
                else "cuBLAS / hipBLASLt (F.linear)")
    syncing = host_syncing_layers(runner)
    if syncing and not config.enforce_eager:
        logger.warning("%d MoE layer(s) run a kernel that reads device values on the host (e.g. %s: %s); "
                       "CUDA graphs and compilation are off for this engine (enforce_eager)",
                       len(syncing), syncing[0][0], syncing[0][1])
        config.enforce_eager = True
    compile_model(runner)
    if runner.compile_level:
        warm_up_compiled(runner)
    mode = effective_graph_mode(config)
    runner.graph_mode = mode
    if mode.decode_mode() == CUDAGraphMode.NONE:
        return
    sizes = [s for s in config.capture_sizes if s <= config.max_num_seqs] or [1]
    # levels 0 and 3 on the Triton backends of either attention kind (MLA models' projections,
    # shared experts and LM head are the same linear layers as a dense model's)
    if runner.attn_backend.name in ("triton", "triton-mla") and runner.decode_forward is runner.model:
        gemv_choice.choose_gemv_shapes(plan, runner.model)  # batch-1 graphs: a Triton GEMV where it beats the unfused layers
        fp8_tile_choice.choose_fp8_tiles(plan, runner.model)  # batch-1 ptpc fp8: the one-row product's tile
        if not triton_gemm:
            # the other sizes and a full prefill step: cuBLASLt's best algorithm per shape. With a
            # compilation cache dir the choice is kept there, so it searches beyond cuBLASLt's
            # heuristic at 64-1024 rows (Llama-3.1-8B on the H200: ~2 min once, +1.4% on the
            # workload); without one every start-up chooses again, among the heuristic's only.
            cache_dir = config.compilation_config.cache_dir
            gemm_choice.choose_lt_algos(plan, runner.model, sizes, cache_dir=cache_dir,
                                        # at level 3 too: compiled steps call atom::plan_linear
                                        prefill_rows=config.max_num_batched_tokens,
                                        wide_rows=(64, 1024) if cache_dir else None, out_dtype=runner.dtype)
    max_blocks = -(-config.max_model_len // runner.block_size)
    runner.graphs = CUDAGraphRunner(runner, sizes, max_blocks)
    runner.graphs.capture()
    if mode.mixed_mode() in (CUDAGraphMode.FULL, CUDAGraphMode.TR_HYBRID):
        why_not = mixed_graphs_refusal(runner)
        if why_not:
            logger.info("steps with prefill tokens run without CUDA graphs (%s mode): %s", mode.name, why_not)
            return
        mixed = MixedGraphRunner(runner, token_buckets(config.max_num_batched_tokens), config.max_num_seqs, max_blocks)
        try:
            mixed.capture(pool=runner.graphs.pool)
        except torch.cuda.OutOfMemoryError as e:  # the decode graphs and the KV cache stay: start without these
            logger.warning("steps with prefill tokens run without CUDA graphs: capturing them ran out of "
                           "memory (%s); lower max_num_batched_tokens or gpu_memory_utilization", e)
            del mixed
            torch.cuda.empty_cache()
            return
        runner.mixed_graphs = mixed


def mixed_graphs_refusal(runner) -> str:
    """Why steps with prefill tokens cannot replay graphs on this engine ('' when they can)."""
    if runner.attn_backend.name != "triton":
        return (f"the {runner.attn_backend.name} attention backend reads host data for them "
                "(only the Triton unified kernel takes padded steps)")
    if runner.parallel.world_size > 1 or runner.parallel.moe_group is not None:
        return "tensor parallel / DP attention (collectives in a padded step: not checked on several GPUs yet)"
    return ""
