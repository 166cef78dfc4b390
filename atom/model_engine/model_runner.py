"""`ModelRunner`: the model, its paged KV cache, and one step = prepare, forward, sample.

    runner = ModelRunner(config)          # builds the model, loads weights, allocates KV
    tokens = runner.run(batch)            # the Scheduler's ScheduledBatch -> tokens per sequence
    runner.plan                           # the engine's kernel plan (choices, fusions)

Inputs of a step are built once, vectorized over the batch with numpy (positions, slot
mapping, block tables), and handed to the attention backend as `AttentionMetadata`.
Logits are computed only for the rows that sample; sampling runs on the device.
Rows that ask for penalties / min_tokens get their logits processed first, rows that ask
for logprobs get them from the raw logits, and sequences whose prompt logprobs are asked get
logits for their prompt positions too (`step_extras`); a batch where no row asks runs
exactly the plain path.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from atom import platform
from atom.distributed.state import ParallelState, building
from atom.model_engine.scheduler import ScheduledBatch, eos_token_ids
from atom.model_engine.sequence import PLACEHOLDER, Sequence
from atom.model_engine.step_extras import StepLogprobs, sample_processed, score_prompts
from atom.model_loader.loader import init_dummy_weights, load_weights
from atom.model_loader.online_quant import OnlineQuantPlan, apply_online_quant
from atom.model_engine.kv_cache import KVCacheManager, kv_cache_dtype_of
from atom.model_ops.attention import AttentionMetadata, forward_context
from atom.model_ops.attention.selector import attention_backend_for, attention_layers
from atom.model_ops.moe import ExpertLoadRecorder, FusedMoE, MoEMethod
from atom.model_ops.quant import LinearMethod, refuse_reference_layers
from atom.model_ops.sampler import Sampler, SamplingTensors
from atom.utils.host_copy import to_device as host_to_device
from atom.models.registry import resolve_architecture
from atom.tuning import fusions
from atom.tuning.fusions import default_fusions
from atom.tuning.plan import KernelPlan

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # KV budget on a CPU when num_kvcache_blocks is -1


@dataclass
class StepInputs:
    """One step's inputs on the host (numpy), before they go to the device."""
    input_ids: np.ndarray     # [T]
    positions: np.ndarray     # [T]
    cu_seqlens_q: np.ndarray  # [B+1]
    seq_lens: np.ndarray      # [B]
    block_tables: np.ndarray  # [B, max_blocks]
    slot_mapping: np.ndarray  # [T]
    query_lens: np.ndarray    # [B]
    sample_rows: list[int]    # sequences that sample (their last 1 + drafts positions)
    num_drafts: np.ndarray | None = None  # [B] draft tokens per sequence; None: no drafts

    @property
    def is_decode(self) -> bool:
        return bool((self.query_lens == 1).all())

    @property
    def decode_q(self) -> int:
        """q when every sequence is a decode of q query tokens (its token + q - 1 drafts),
        else 0: the batches a CUDA graph of (batch size, q) can run."""
        if self.num_drafts is None:
            return 1 if self.is_decode else 0
        q = int(self.query_lens[0])
        return q if bool((self.query_lens == q).all() & (self.num_drafts == q - 1).all()) else 0

    @property
    def sample_counts(self) -> np.ndarray | None:
        """Positions sampled per sample row (1 + its drafts); None: one each."""
        return None if self.num_drafts is None else self.num_drafts[self.sample_rows] + 1


@dataclass
class StepHandle:
    """A launched step: its sampled tokens on the device, and how to get them back."""
    num_seqs: int
    sample_rows: list[int]
    row_of_seq: dict[int, int]          # seq_id -> row of `tokens` (steps without drafts)
    tokens: torch.Tensor | None = None  # device, one per sampled position (sample rows in order)
    sample_counts: list[int] | None = None  # positions per sample row; None: one each
    host_tokens: torch.Tensor | None = None
    event: "torch.cuda.Event | None" = None
    graph_size: int | None = None       # the decode CUDA graph replayed (its batch size), None: none
    mixed_graph: int | None = None      # the token bucket of the mixed-step graph replayed, None: none
    timing: dict = field(default_factory=dict)  # prepare_s, launch_s, sample_s (host seconds)
    logprobs: StepLogprobs | None = None  # rows that ask (step_extras); on the host after collect
    expert_counts: "torch.Tensor | np.ndarray | None" = None  # [MoE layers, experts] pairs (routing stats)
    expert_layers: list[int] | None = None  # the decoder layer of each row of expert_counts


class ModelRunner:
    def __init__(self, config, device: torch.device | str | None = None, parallel: ParallelState | None = None,
                 moe_group: ParallelState | None = None):
        """`parallel`: this rank's tensor-parallel group (None: one rank). Rank 0 (the driver)
        sends each step to the other ranks (`atom.distributed.worker.serve`) as it launches it.
        `moe_group`: under DP attention, the data-parallel replicas' group the MoE layers
        span (every forward, and `dummy_moe_step` when this replica has nothing to run,
        pairs with the other replicas')."""
        self.config = config
        self.parallel = parallel if parallel is not None else ParallelState.single()
        # enable_expert_parallel: the MoE layers split whole experts over the TP ranks (EP size = TP size),
        # or, under DP attention, over the replicas (EP size = DP size)
        self.parallel.expert_parallel = bool(getattr(config, "enable_expert_parallel", False))
        self.parallel.moe_group = moe_group
        if moe_group is not None:
            moe_group.expert_parallel = self.parallel.expert_parallel
        self._released: list[int] = []  # seq ids finished since the last step (sent to the workers)
        self.on_failure = None  # set by a TensorParallelExecutor: error, what -> the error to raise
        self.num_steps = 0
        self.device = torch.device(device) if device is not None else platform.default_device()
        self.block_size = config.kv_cache_block_size
        hf = config.hf_config
        self.dtype = config.torch_dtype if isinstance(config.torch_dtype, torch.dtype) else torch.bfloat16
        model_cls = resolve_architecture(hf)  # before anything expensive
        if self.parallel.world_size > 1:
            from atom.distributed.executor import check_tensor_parallel
            check_tensor_parallel(config)
        quant_config = getattr(config, "quant_config", None)
        if quant_config is not None:  # checkpoint names (q_proj) -> the packed layers (qkv_proj)
            quant_config.remap_layer_name(hf, getattr(model_cls, "packed_modules_mapping", None))
        t0 = time.perf_counter()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), building(self.parallel):
                self.model = model_cls(hf, quant_config)
        finally:
            torch.set_default_dtype(prev)
        if self.parallel.expert_parallel and not any(isinstance(m, FusedMoE) for m in self.model.modules()):
            logger.warning("enable_expert_parallel=True has no effect on %s: it has no MoE layers "
                           "(its layers are tensor-parallel as without it)", type(self.model).__name__)
        online = OnlineQuantPlan.from_config(config)
        if self.device.type == "cuda":  # a format without a GPU kernel (unless re-quantized), before loading
            rocm = torch.version.hip is not None  # (there re-quantized layers run the reference too)
            skip = online.targeted(self.model) if online is not None and not rocm else ()
            refuse_reference_layers(self.model, skip=skip, rocm=rocm)
        if online is not None:  # refusals (a format without a method, a source it cannot read) before loading
            online.check(self.model)
        if config.load_dummy:
            init_dummy_weights(self.model, config.load_dummy, self.dtype)
        else:
            load_weights(self.model, config.model)
        for m in self.model.modules():
            if isinstance(getattr(m, "method", None), (LinearMethod, MoEMethod)):
                m.method.process_weights_after_loading(m)
        # online_quant_config: each targeted layer re-quantized in place; the summary it wrote
        self.online_quant_info = apply_online_quant(self.model, config, online) if online is not None else None
        for m in self.model.modules():  # layers that derive tensors from their final weights (MLA's kv_b)
            if hasattr(m, "finish_loading"):
                m.finish_loading(self.dtype)
        self.model.eval()
        self.model_forward = self.model  # replaced by a compiled callable at levels 1-3
        self.decode_forward = self.model  # what decode CUDA graphs capture (gpu_setup decides)
        self.compile_level = 0
        self.graph_mode = None
        self.expert_recorder: ExpertLoadRecorder | None = None  # routing statistics (record_expert_load)
        self.attn_layers = attention_layers(self.model)
        kernels = platform.kernel_backend() if self.device.type == "cuda" else "torch"
        # by the layers' kind (full / latent); a GPU backend owns the op's scratch
        self.attn_backend = attention_backend_for(self.attn_layers, kernels, max_num_tokens=1024, device=self.device)
        self.set_attention_backend(self.attn_backend)
        self.plan = None
        self.install_plan(KernelPlan(backend=kernels, fusions=default_fusions(kernels)))
        self.sampler = Sampler(self.plan)
        self.generators: dict[int, torch.Generator] = {}
        self.eos_token_ids = eos_token_ids(config)  # what min_tokens suppresses (unless ignore_eos)
        logger.info("loaded %s (%s, %s) in %.1f s", type(self.model).__name__, self.dtype,
                    self.device, time.perf_counter() - t0)
        # "bf16": the model's dtype; "fp8": e4m3 entries (half a bf16 page: twice the blocks)
        self.kv_dtype = kv_cache_dtype_of(getattr(config, "kv_cache_dtype", "bf16"), self.dtype)
        self.kv_cache_manager = KVCacheManager(
            {a.layer_idx: (a, a.kv_cache_spec(self.kv_dtype)) for a in self.attn_layers}, self.block_size, self.device)
        self.num_blocks = self.allocate_kv_cache()
        self._pinned: list[torch.Tensor | None] = [None, None]  # sampled-token copies, alternating
        self._pinned_turn = 0
        self.graphs = None        # decode steps' CUDA graphs (cuda_graphs.CUDAGraphRunner)
        self.mixed_graphs = None  # steps with prefill tokens (mixed_graphs.MixedGraphRunner)
        if self.device.type == "cuda":
            self.setup_gpu()
        self.arm_kv_scale_calibration()

    def arm_kv_scale_calibration(self) -> int:
        """FP8 KV cache: layers without checkpoint scales compute theirs at the first cache
        write from now on (after warm-up and graph capture, so from real tokens); returns how
        many layers were armed."""
        if self.kv_dtype.itemsize >= 2:
            return 0
        armed = [a for a in self.attn_layers if hasattr(a, "calibrate_kv_scales")
                 and getattr(a, "kv_scale_source", "") != "checkpoint"]
        for a in armed:
            a.kv_scale_pending = True
            a.kv_scale_source = "pending (first prefill)"
        if armed:
            logger.info("FP8 KV cache: %d layer(s) compute their scales from the first prefill", len(armed))
        return len(armed)

    @property
    def kv_scales_pending(self) -> bool:
        """Whether an FP8 KV-cache layer still computes its scales at its next cache write
        (host code a CUDA graph would skip: such a step runs eagerly)."""
        return any(getattr(a, "kv_scale_pending", False) for a in self.attn_layers)

    # --- DP attention ----------------------------------------------------------------------------
    @torch.inference_mode()
    def dummy_moe_step(self) -> int:
        """A replica with nothing to run while others step (DP attention): each MoE layer,
        in forward order, on no tokens of its own, so its collectives pair with theirs and its
        experts serve their tokens. Returns the number of MoE layers run."""
        layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        for m in layers:
            x = torch.empty(0, m.hidden_size, dtype=self.dtype, device=self.device)
            m(x, torch.empty(0, m.num_experts, dtype=self.dtype, device=self.device))
        return len(layers)

    # --- routing statistics -------------------------------------------------------------------
    def record_expert_load(self, on: bool = True) -> ExpertLoadRecorder | None:
        """Count (token, expert) pairs per MoE layer in every step (`StepHandle.expert_counts`).
        While on, steps run eagerly, without CUDA graphs (a graph would count its padding rows
        too) and without the compiled model."""
        if self.expert_recorder is not None:
            self.expert_recorder.detach()
            self.expert_recorder = None
        if on:
            layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
            self.expert_recorder = ExpertLoadRecorder(layers, self.device).attach()
        return self.expert_recorder

    # --- the kernel plan ------------------------------------------------------------------
    def install_plan(self, plan: KernelPlan) -> KernelPlan:
        """Hand `plan` to every layer that consults one and install its fusions on the
        decoder layers (replacing an earlier plan's). CUDA graphs captured before replay the
        kernels of the plan they were captured with."""
        captured = (getattr(self, "graphs", None) is not None or getattr(self, "mixed_graphs", None) is not None
                    or getattr(self, "compile_level", 0) > 0)
        if plan.has("fp4_pair_words") and captured and fusions.pending_pair_words(self.model):
            raise ValueError("fusions=['fp4_pair_words'] rewrites MXFP4 weights in place: it must be in the plan "
                             "installed before CUDA graphs and torch.compile capture the model (these already read "
                             "the checkpoint's layout); install it first, or not at all")
        fusions.uninstall(self.model)
        for m in self.model.modules():
            if "plan" in m.__dict__:
                m.plan = plan
                if hasattr(m, "plan_installed"):  # layers that read their choices once (MoE tiles)
                    m.plan_installed(plan)
        fusions.install(self.model, plan)
        self.plan = plan
        if getattr(self, "sampler", None) is not None:
            self.sampler.plan = plan
        return plan

    def set_attention_backend(self, backend) -> None:
        """Serve every attention layer with `backend` (e.g. a `TritonAttentionBackend` under
        Triton's interpreter on a CPU); the cache views stay as allocated."""
        self.attn_backend = backend
        for layer in self.attn_layers:
            layer.backend = backend

    def bind(self, meta: AttentionMetadata) -> AttentionMetadata:
        """This engine's plan and attention backend into a forward's metadata."""
        meta.plan, meta.attn_backend = self.plan, self.attn_backend
        return meta

    # --- KV cache --------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_cache_manager.bytes_per_block

    @property
    def kv_cache_config(self):
        """The guide's `KVCacheConfig`: one `KVCacheTensor` per attention layer."""
        return self.kv_cache_manager.kv_cache_config()

    def get_num_blocks(self) -> int:
        if self.config.num_kvcache_blocks > 0:
            return self.config.num_kvcache_blocks
        if self.device.type == "cuda":
            activations = self.profile_activation_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * self.config.gpu_memory_utilization - (total - free) - activations
        else:
            budget = CPU_KV_CACHE_BYTES
        # never more than max_num_seqs full-length sequences need
        cap = self.config.max_num_seqs * -(-self.config.max_model_len // self.block_size)
        n = self.parallel.min_int(min(self.kv_cache_manager.num_blocks_for(budget), cap))  # ranks agree
        if n < 1:
            raise ValueError(f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves no "
                             "memory for the KV cache: raise it or lower max_num_batched_tokens")
        return n

    def profile_activation_bytes(self) -> int:
        """Peak memory of a dummy prefill of max_num_batched_tokens tokens (GPU only).

        Runs the forward and the LM head on sequences of at most max_model_len tokens,
        against a temporary KV cache just big enough for them, and measures the peak of
        what the forward allocated on top of that."""
        cfg = self.config
        total = cfg.max_num_batched_tokens
        seqs, num_blocks = self.dummy_prefills([min(cfg.max_model_len, total - i)
                                                for i in range(0, total, cfg.max_model_len)])
        self.kv_cache_manager.allocate(num_blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            hidden, meta = self.dummy_forward(seqs)
            self.model.compute_logits(hidden[meta.cu_seqlens_q[1:].long() - 1]).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.kv_cache_manager.release()
        del hidden
        torch.cuda.empty_cache()
        logger.info("profiling forward of %d tokens: peak %.2f GiB of activations", total, peak / 2**30)
        return peak

    def dummy_prefills(self, lens: list[int]) -> tuple[list[Sequence], int]:
        """Whole-prompt prefills of these lengths (token ids 0..n-1) over consecutive blocks
        from block 0, and the number of blocks they take (for profiling and warm-up)."""
        seqs, num_blocks = [], 0
        for n in lens:
            s = Sequence(list(range(n)))
            s.block_table = list(range(num_blocks, num_blocks + -(-n // self.block_size)))
            s.num_new_tokens = n
            num_blocks += len(s.block_table)
            seqs.append(s)
        return seqs, num_blocks

    def dummy_forward(self, seqs: list[Sequence]) -> tuple[torch.Tensor, AttentionMetadata]:
        """The forward of `seqs` (from `dummy_prefills`) on token id 0 everywhere: (hidden, meta)."""
        input_ids, positions, meta = self.to_device(self.prepare_host(seqs))
        return self.forward(torch.zeros_like(input_ids), positions, meta), meta

    def allocate_kv_cache(self) -> int:
        n = self.get_num_blocks()
        self.kv_cache_manager.allocate(n)
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB)", n, self.block_size,
                    self.kv_cache_manager.nbytes / 2**30)
        return n

    # --- one step --------------------------------------------------------------------
    def prepare_host(self, seqs: list[Sequence]) -> StepInputs:
        """A step's inputs as numpy arrays, vectorized over the batch."""
        bs = self.block_size
        qlens = np.fromiter((s.num_new_tokens for s in seqs), np.int64, len(seqs))
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
        seq_lens = starts + qlens
        cu = np.zeros(len(seqs) + 1, np.int64)
        np.cumsum(qlens, out=cu[1:])
        ids: list[int] = []
        for s in seqs:
            ids.extend(s.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens])
        row_of_token = np.repeat(np.arange(len(seqs)), qlens)
        positions = np.arange(int(cu[-1])) - cu[:-1][row_of_token] + starts[row_of_token]
        # block tables: one flat copy, scattered into a padded [B, max_blocks] array
        nblocks = np.fromiter((len(s.block_table) for s in seqs), np.int64, len(seqs))
        flat = np.fromiter(itertools.chain.from_iterable(s.block_table for s in seqs), np.int64, int(nblocks.sum()))
        tables = np.full((len(seqs), int(nblocks.max())), -1, np.int64)
        row_of_block = np.repeat(np.arange(len(seqs)), nblocks)
        first_block = np.cumsum(nblocks) - nblocks
        tables[row_of_block, np.arange(len(flat)) - first_block[row_of_block]] = flat
        slots = tables[row_of_token, positions // bs] * bs + positions % bs
        drafts = None
        if int(cu[-1]) != len(seqs):  # not one token each: a step may carry drafts
            drafts = np.fromiter((s.num_draft_tokens for s in seqs), np.int64, len(seqs))
            drafts = drafts if drafts.any() else None
        return StepInputs(np.asarray(ids, np.int64), positions, cu, seq_lens, tables, slots, qlens,
                          [i for i, s in enumerate(seqs) if s.samples_this_step], drafts)

    def to_device(self, x: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        t = self._to_device
        meta = AttentionMetadata(
            cu_seqlens_q=t(x.cu_seqlens_q, torch.int32), seq_lens=t(x.seq_lens, torch.int32),
            block_tables=t(x.block_tables, torch.int32), slot_mapping=t(x.slot_mapping, torch.int64),
            max_query_len=int(x.query_lens.max()), max_seq_len=int(x.seq_lens.max()),
            query_lens_host=x.query_lens.tolist(), seq_lens_host=x.seq_lens.tolist())
        return t(x.input_ids, torch.int64), t(x.positions, torch.int64), meta

    def _to_device(self, array, dtype=None) -> torch.Tensor:
        """Host data to the device without a stream sync (the host never waits on the GPU)."""
        return host_to_device(array, self.device, dtype)

    def sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        sps = [s.sampling_params for s in seqs]
        temps = [sp.temperature for sp in sps]
        if all(t == 0 for t in temps):  # argmax only: no per-row tensors to copy
            st = SamplingTensors(None)
            st.all_greedy = True
            return st
        st = SamplingTensors(self._to_device(temps, torch.float32))
        if any(sp.top_k not in (-1, 0, None) for sp in sps):
            st.top_ks = self._to_device([sp.top_k if sp.top_k and sp.top_k > 0 else 0 for sp in sps], torch.int64)
        if any(sp.top_p < 1.0 for sp in sps):
            st.top_ps = self._to_device([sp.top_p for sp in sps], torch.float32)
        for row, s in enumerate(seqs):
            if s.sampling_params.seed is not None and s.sampling_params.temperature > 0:
                gen = self.generators.get(s.seq_id)
                if gen is None:
                    gen = torch.Generator(device=self.device).manual_seed(s.sampling_params.seed)
                    self.generators[s.seq_id] = gen
                st.generators[row] = gen
        return st

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model on one step's inputs: compiled (levels 1-3), or eager while routing
        statistics are recorded (the recorder is host-side bookkeeping a graph would not see)."""
        fn = self.model if self.expert_recorder is not None else self.model_forward
        with forward_context(self.bind(meta)):
            return fn(input_ids, positions)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch | list[Sequence]) -> list[list[int]]:
        """Run one step; returns the sampled tokens per sequence (see `collect`)."""
        return self.collect(self.launch(batch))

    def launch(self, batch: ScheduledBatch | list[Sequence], prev: "StepHandle | None" = None) -> "StepHandle":
        """Enqueue a step's forward and sampling on the device without waiting for it.

        With `prev`, placeholder input tokens (a look-ahead step) are taken on the device
        from the tokens `prev` sampled, so no host round trip separates the two steps.
        Under tensor parallel, an error is handed to `on_failure` (the executor's: a rank
        that died becomes a `WorkerFailure` naming it and this step)."""
        if self.on_failure is None:
            return self._launch(batch, prev)
        try:
            return self._launch(batch, prev)
        except BaseException as e:  # the ranks are out of step now: on_failure stops the engine
            seqs = batch.seqs if isinstance(batch, ScheduledBatch) else batch
            n_prefill = sum(1 for s in seqs if s.num_new_tokens > 1)
            doing = (f"running step {self.num_steps} ({n_prefill} prefill and {len(seqs) - n_prefill} decode "
                     "sequences)")
            error = self.on_failure(e, doing)
            if error is e:
                raise
            raise error from e

    @torch.inference_mode()
    def _launch(self, batch: ScheduledBatch | list[Sequence], prev: "StepHandle | None" = None) -> "StepHandle":
        seqs = batch.seqs if isinstance(batch, ScheduledBatch) else batch
        self.num_steps += 1
        t0 = time.perf_counter()
        if self.parallel.world_size > 1 and self.parallel.is_driver:
            if prev is not None:
                raise ValueError("look-ahead steps (async_scheduling) do not run under tensor parallel yet")
            self.publish(("step", [step_view(s) for s in seqs], self._released))
            self._released = []
        host = self.prepare_host(seqs)
        t1 = time.perf_counter()
        fed = None
        if prev is not None and (host.input_ids == PLACEHOLDER).any():
            src = [prev.row_of_seq[s.seq_id] for s in seqs]  # one placeholder per row
            if len(src) == prev.tokens.shape[0] and src == list(range(len(src))):
                fed = prev.tokens  # the same rows in the same order (always at batch 1): no gather
            else:
                fed = prev.tokens[self._to_device(np.asarray(src, np.int64))]
        graphs, mixed = self.graphs, self.mixed_graphs
        graph_size = mixed_size = None
        if graphs is not None and self.expert_recorder is None and graphs.can_run(host):
            hidden = graphs.replay(host, fed)
            graph_size = graphs.last_size
        elif (mixed is not None and fed is None and self.expert_recorder is None and not host.is_decode
              and (key := mixed.bucket(host)) is not None and not self.kv_scales_pending):
            hidden = mixed.replay(host, key)
            mixed_size = mixed.last_size
        else:
            input_ids, positions, meta = self.to_device(host)
            hidden = self.forward(fed if fed is not None else input_ids, positions, meta)
        handle = StepHandle(len(seqs), host.sample_rows, {seqs[r].seq_id: i for i, r in enumerate(host.sample_rows)},
                            graph_size=graph_size, mixed_graph=mixed_size)
        if self.expert_recorder is not None:
            handle.expert_counts = self.expert_recorder.take()
            handle.expert_layers = self.expert_recorder.layer_ids
        if any(s.needs_prompt_logprobs for s in seqs):
            score_prompts(self, seqs, host.cu_seqlens_q, hidden, handle)
        if host.sample_rows:
            n = len(seqs)
            counts = host.sample_counts
            sample_seqs = [seqs[r] for r in host.sample_rows]
            if counts is not None:  # drafts: every position of a drafted row samples
                ends = host.cu_seqlens_q[1:][host.sample_rows]
                first = np.repeat(np.cumsum(counts) - counts, counts)
                idx = np.repeat(ends - counts, counts) + np.arange(int(counts.sum())) - first
                rows = hidden[self._to_device(idx)]
                sample_seqs = [s for s, c in zip(sample_seqs, counts.tolist()) for _ in range(c)]
                handle.sample_counts = counts.tolist()
            elif len(host.sample_rows) == n and int(host.cu_seqlens_q[n]) == n:
                rows = hidden[:n]  # one token per sequence, all sampled (decode): no gather
            else:
                last = self._to_device(host.cu_seqlens_q[1:][host.sample_rows] - 1)
                rows = hidden[last]
            logits = self.model.compute_logits(rows)
            if any(s.needs_step_tokens for s in sample_seqs):  # penalties, min_tokens, logprobs
                handle.tokens = sample_processed(self, logits, seqs, host.sample_rows, counts, sample_seqs, handle)
            else:
                handle.tokens = self.sampler(logits, self.sampling_tensors(sample_seqs))
            num = len(sample_seqs)
            if self.device.type == "cuda":  # copy back into pinned memory, signalled by an event
                self._pinned_turn ^= 1
                buf = self._pinned[self._pinned_turn]
                if buf is None or buf.numel() < num:
                    buf = self._pinned[self._pinned_turn] = torch.empty(
                        max(num, self.config.max_num_seqs), dtype=torch.int64, pin_memory=True)
                handle.host_tokens = buf[:num]
                handle.host_tokens.copy_(handle.tokens, non_blocking=True)
                handle.event = torch.cuda.Event()
                handle.event.record()
        handle.timing = {"prepare_s": t1 - t0, "launch_s": time.perf_counter() - t1}
        return handle

    def collect(self, handle: "StepHandle") -> list[list[int]]:
        """Wait for a launched step; the sampled tokens per sequence: [] where nothing was
        sampled (a prefill chunk mid-prompt), [t] for a plain step, 1 + k tokens for a step
        with k drafts (the target's sample at each position, unverified)."""
        t0 = time.perf_counter()
        rows = handle.sample_rows
        if not rows:
            out: list[list[int]] = [[] for _ in range(handle.num_seqs)]
        else:
            if handle.event is not None:
                handle.event.synchronize()
                tokens = handle.host_tokens.tolist()
            else:
                tokens = handle.tokens.tolist()
            if handle.sample_counts is None and len(rows) == handle.num_seqs:
                out = [[t] for t in tokens]  # every row sampled one (decode)
            else:
                out = [[] for _ in range(handle.num_seqs)]
                if handle.sample_counts is None:
                    for r, tok in zip(rows, tokens):
                        out[r] = [tok]
                else:
                    at = 0
                    for r, c in zip(rows, handle.sample_counts):
                        out[r] = tokens[at:at + c]
                        at += c
        if handle.logprobs is not None:
            handle.logprobs.to_host(handle.num_seqs)
        if handle.expert_counts is not None:
            handle.expert_counts = handle.expert_counts.cpu().numpy()
        handle.timing["sample_s"] = time.perf_counter() - t0  # waiting for the device
        return out

    # --- GPU: attention op, compilation, CUDA graphs ------------------------------------
    def setup_gpu(self) -> None:
        from atom.model_engine import gpu_setup
        gpu_setup.setup(self)

    # --- torch profiler (torch_profiler_dir / ATOM_TORCH_PROFILER_DIR, ATOM_PROFILER_MORE) ------
    def start_profile(self) -> None:
        from atom.utils import envs
        folder = self.config.torch_profiler_dir
        if not folder:
            raise ValueError("torch_profiler_dir is not set: pass it or set ATOM_TORCH_PROFILER_DIR")
        more = bool(envs.ATOM_PROFILER_MORE)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=acts, record_shapes=more, with_stack=more, profile_memory=more,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(folder, use_gzip=True))
        self.profiler.start()
        logger.info("torch profiler started (detailed=%s), traces go to %s", more, folder)

    def stop_profile(self) -> None:
        if getattr(self, "profiler", None) is None:
            raise RuntimeError("stop_profile() without start_profile()")
        self.profiler.stop()
        self.profiler = None

    def release(self, seq: Sequence | int) -> None:
        """Forget per-request state (its sampling generator) once it finished (the workers
        with the next step)."""
        seq_id = seq if isinstance(seq, int) else seq.seq_id
        self.generators.pop(seq_id, None)
        if self.parallel.world_size > 1 and self.parallel.is_driver:
            self._released.append(seq_id)

    # --- tensor parallel: the driver's messages to the other ranks -----------------------
    def publish(self, message: tuple) -> None:
        """Rank 0: one message (a step, or "stop") to every other rank, once."""
        self.parallel.broadcast_object(message)

    def __repr__(self) -> str:
        tp = f", tp_rank={self.parallel.rank}/{self.parallel.world_size}" if self.parallel.world_size > 1 else ""
        return (f"ModelRunner({type(self.model).__name__}, device={self.device}, dtype={self.dtype}{tp}, "
                f"kv_blocks={self.num_blocks}x{self.block_size}, attention={self.attn_backend.name}, plan={self.plan!r})")


_NOT_SENT = ("forks", "prompt_token_ids", "prompt")  # what the workers' runners never read


def step_view(seq: Sequence) -> Sequence:
    """A copy of `seq` with what a runner reads in a step (no siblings, no prompt text), for
    sending to the other tensor-parallel ranks."""
    view = object.__new__(Sequence)
    view.__dict__ = {k: v for k, v in seq.__dict__.items() if k not in _NOT_SENT}
    view.forks = []
    return view
