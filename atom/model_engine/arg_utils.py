"""Command-line arguments of the engine: :class:`EngineArgs` -> :class:`Config`.

Each flag of the configuration guide is a field here; ``add_cli_args`` registers
them (every documented spelling, plus the hyphen/underscore twin of flags the
guide spells with underscores), ``from_cli_args`` reads a parsed namespace back,
and ``create_engine_config`` builds the validated :class:`~atom.config.Config`.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
from dataclasses import dataclass, fields
from typing import Any, Optional

from atom.config import (
    INDEX_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    LOAD_DUMMY_CHOICES,
    CompilationConfig,
    Config,
    ParallelConfig,
    SpeculativeConfig,
)

logger = logging.getLogger(__name__)

__all__ = ["EngineArgs", "DEFAULT_CUDAGRAPH_CAPTURE_SIZES", "parse_capture_sizes"]

DEFAULT_CUDAGRAPH_CAPTURE_SIZES = "[1,2,3,4,5,6,7,8,16,32,48,64,128,256,512]"


def parse_capture_sizes(text: str) -> list[int]:
    """``"[1,2,4]"`` -> ``[1, 2, 4]`` (sorted, deduplicated); a bare integer is one size."""
    flag = "--cudagraph-capture-sizes"
    try:
        value = ast.literal_eval(text) if isinstance(text, str) else text
    except (ValueError, SyntaxError):
        raise ValueError(
            f"{flag}={text!r} is invalid: must be a Python list of integers, e.g. '[1,2,4,8]'"
        ) from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    ):
        raise ValueError(
            f"{flag}={text!r} is invalid: must be a non-empty list of integers >= 1"
        )
    return sorted(set(value))


def _parse_online_quant(text: Optional[str]) -> Optional[dict]:
    if text is None:
        return None
    if isinstance(text, dict):
        return text or None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--online_quant_config={text!r} is invalid: must be a JSON object ({exc})"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"--online_quant_config={text!r} is invalid: must be a JSON object")
    return value or None


@dataclass
class EngineArgs:
    """Every engine CLI flag, with the guide's defaults."""

    model: str = "Qwen/Qwen3-0.6B"
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enforce_eager: bool = False
    enable_prefix_caching: bool = False
    enable_log_stats: bool = True
    throughput_log_interval: float = 10.0
    port: int = 8006
    kv_cache_dtype: str = "bf16"
    index_cache_dtype: Optional[str] = None
    block_size: int = 16
    max_model_len: Optional[int] = None
    cudagraph_capture_sizes: str = DEFAULT_CUDAGRAPH_CAPTURE_SIZES
    level: int = 3
    load_dummy: Optional[str] = None
    enable_expert_parallel: bool = False
    torch_profiler_dir: Optional[str] = None
    enable_dp_attention: bool = False
    method: Optional[str] = None
    num_speculative_tokens: int = 1
    max_num_batched_tokens: int = 16384
    state_checkpoint_interval_tokens: int = 8192
    state_checkpoint_demand: bool = True
    decoder_swa_bounded_replay: bool = True
    encoder_swa_bounded_replay: bool = True
    max_num_seqs: int = 512
    gpu_memory_utilization: float = 0.9
    scheduler_delay_factor: float = 0.0
    online_quant_config: Optional[str] = None
    # Beyond the guide (vLLM's flags): the model's dtype and a global seed.
    dtype: str = "auto"
    seed: Optional[int] = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Register every engine flag on ``parser`` and return it."""
        d = EngineArgs
        bool_opt = argparse.BooleanOptionalAction
        g = parser.add_argument_group("engine")
        g.add_argument("--model", type=str, default=d.model, help="Model name or local path.")
        g.add_argument("--trust-remote-code", action="store_true",
                       help="Trust remote code when loading the model.")
        g.add_argument("--tensor-parallel-size", "-tp", type=int,
                       default=d.tensor_parallel_size, help="Tensor parallel size (1-8).")
        g.add_argument("--data-parallel-size", "-dp", type=int,
                       default=d.data_parallel_size, help="Data parallel size.")
        g.add_argument("--enforce-eager", action="store_true",
                       help="Run eagerly: no compilation, no CUDA graphs.")
        g.add_argument("--enable_prefix_caching", "--enable-prefix-caching",
                       dest="enable_prefix_caching", action="store_true",
                       help="Reuse KV blocks across requests sharing a prefix.")
        g.add_argument("--enable-log-stats", action=bool_opt, default=d.enable_log_stats,
                       help="Emit the periodic engine-status line.")
        g.add_argument("--throughput-log-interval", type=float,
                       default=d.throughput_log_interval,
                       help="Seconds between engine-status lines (> 0).")
        g.add_argument("--port", type=int, default=d.port, help="Engine internal port.")
        g.add_argument("--kv_cache_dtype", "--kv-cache-dtype", dest="kv_cache_dtype",
                       choices=list(KV_CACHE_DTYPES), default=d.kv_cache_dtype,
                       help="KV cache dtype.")
        g.add_argument("--index-cache-dtype", "--index_cache_dtype", dest="index_cache_dtype",
                       choices=list(INDEX_CACHE_DTYPES), default=None,
                       help="Indexer-cache dtype (DeepSeek-V4; no effect in this build). "
                            "Omitted: Config's model-aware default.")
        g.add_argument("--block-size", type=int, default=d.block_size,
                       help="KV cache block size: a multiple of 16 or exactly 1.")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="Maximum context length (default: max_position_embeddings).")
        g.add_argument("--cudagraph-capture-sizes", type=str,
                       default=d.cudagraph_capture_sizes,
                       help="CUDA graph capture sizes as a Python list string.")
        g.add_argument("--level", type=int, default=d.level, help="Compilation level (0-3).")
        g.add_argument("--load_dummy", "--load-dummy", dest="load_dummy", nargs="?",
                       const="empty", default=None, choices=list(LOAD_DUMMY_CHOICES),
                       help="Dummy weights: bare/=empty skip load, =zero, =xavier.")
        g.add_argument("--enable-expert-parallel", action="store_true",
                       help="Enable expert parallelism for MoE models.")
        g.add_argument("--torch-profiler-dir", type=str, default=None,
                       help="Directory for torch profiler traces "
                            "(default: $ATOM_TORCH_PROFILER_DIR).")
        g.add_argument("--enable-dp-attention", action="store_true",
                       help="Enable data-parallel attention.")
        g.add_argument("--method", type=str, choices=["mtp"], default=None,
                       help="Speculative decoding method.")
        g.add_argument("--num-speculative-tokens", type=int,
                       default=d.num_speculative_tokens,
                       help="Speculative tokens per iteration (must be 1).")
        g.add_argument("--max-num-batched-tokens", type=int,
                       default=d.max_num_batched_tokens,
                       help="Maximum tokens batched per scheduler step.")
        g.add_argument("--state-checkpoint-interval-tokens", type=int,
                       default=d.state_checkpoint_interval_tokens,
                       help="Tokens between state-checkpoint rungs; 0 off, -1 ladder off.")
        g.add_argument("--state-checkpoint-demand", action=bool_opt,
                       default=d.state_checkpoint_demand,
                       help="Let a refused prefix hit place its own checkpoint rung.")
        g.add_argument("--decoder-swa-bounded-replay", "--enable-decoder-swa-bounded-replay",
                       dest="decoder_swa_bounded_replay", action=bool_opt,
                       default=d.decoder_swa_bounded_replay,
                       help="DeepSeek-V4.1 decoder SWA bounded replay "
                            "(no effect in this build).")
        g.add_argument("--encoder-swa-bounded-replay", "--enable-encoder-swa-bounded-replay",
                       dest="encoder_swa_bounded_replay", action=bool_opt,
                       default=d.encoder_swa_bounded_replay,
                       help="DeepSeek-V4.1 encoder SWA bounded replay "
                            "(no effect in this build).")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                       help="Maximum sequences batched together.")
        g.add_argument("--gpu-memory-utilization", type=float,
                       default=d.gpu_memory_utilization,
                       help="Fraction of GPU memory to use, in (0, 1].")
        g.add_argument("--scheduler-delay-factor", type=float,
                       default=d.scheduler_delay_factor,
                       help="Delay x previous prompt latency before the next prompt.")
        g.add_argument("--online_quant_config", "--online-quant-config",
                       dest="online_quant_config", type=str, default=None,
                       help="JSON object: load-time online quantization targets.")
        g.add_argument("--dtype", type=str, default=d.dtype,
                       help="Model dtype: auto (the checkpoint's), bfloat16/bf16, "
                            "float16/fp16/half, float32/fp32/float.")
        g.add_argument("--seed", type=int, default=d.seed,
                       help="Seed Python's, numpy's and torch's RNGs once at start-up.")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """Build from a namespace produced by a parser that ran :meth:`add_cli_args`."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def _config_kwargs(self) -> dict[str, Any]:
        sizes = parse_capture_sizes(self.cudagraph_capture_sizes)
        kwargs: dict[str, Any] = dict(
            model=self.model,
            trust_remote_code=self.trust_remote_code,
            tensor_parallel_size=self.tensor_parallel_size,
            parallel_config=ParallelConfig(data_parallel_size=self.data_parallel_size),
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_log_stats=self.enable_log_stats,
            throughput_log_interval=self.throughput_log_interval,
            port=self.port,
            kv_cache_dtype=self.kv_cache_dtype,
            index_cache_dtype=self.index_cache_dtype,
            kv_cache_block_size=self.block_size,
            max_model_len=self.max_model_len,
            compilation_config=CompilationConfig(
                level=self.level, cudagraph_capture_sizes=sizes
            ),
            load_dummy=self.load_dummy,
            enable_expert_parallel=self.enable_expert_parallel,
            enable_dp_attention=self.enable_dp_attention,
            max_num_batched_tokens=self.max_num_batched_tokens,
            state_checkpoint_interval_tokens=self.state_checkpoint_interval_tokens,
            state_checkpoint_demand=self.state_checkpoint_demand,
            enable_decoder_swa_bounded_replay=self.decoder_swa_bounded_replay,
            enable_encoder_swa_bounded_replay=self.encoder_swa_bounded_replay,
            max_num_seqs=self.max_num_seqs,
            gpu_memory_utilization=self.gpu_memory_utilization,
            scheduler_delay_factor=self.scheduler_delay_factor,
            online_quant_config=_parse_online_quant(self.online_quant_config),
        )
        # Leave Config's default (which reads $ATOM_TORCH_PROFILER_DIR) alone unless set.
        if self.torch_profiler_dir is not None:
            kwargs["torch_profiler_dir"] = self.torch_profiler_dir
        if self.method is not None:
            kwargs["speculative_config"] = SpeculativeConfig(
                method=self.method, model=None, num_speculative_tokens=self.num_speculative_tokens
            )
        return kwargs

    def create_engine_config(self, **overrides: Any) -> Config:
        """The validated :class:`Config` these arguments describe (``--dtype`` applied to
        ``torch_dtype``); ``overrides``: Config fields no flag sets (the server's
        ``asyncio_mode=True``)."""
        from atom.utils.dtypes import parse_dtype
        from atom.utils.seed import check_seed

        dtype = parse_dtype(self.dtype, "--dtype")
        check_seed(self.seed, "--seed")
        config = Config(**{**self._config_kwargs(), **overrides})
        if dtype is not None:
            config.torch_dtype = dtype
        return config

    def create_engine(self, **overrides: Any):
        """Build the config and an :class:`~atom.model_engine.llm_engine.LLMEngine` on it
        (``--dtype`` applied, the RNGs seeded with ``--seed``); ``overrides`` as in
        :meth:`create_engine_config` (the server's ``asyncio_mode=True``)."""
        config = self.create_engine_config(**overrides)
        from atom.model_engine.llm_engine import LLMEngine
        from atom.utils.seed import set_seed

        set_seed(self.seed)
        dp = config.parallel_config.data_parallel_size
        if dp > 1:  # replicas in their own processes: that engine is the LLM's
            raise ValueError(f"parallel_config.data_parallel_size={dp} is invalid for one LLMEngine: "
                             "use create_llm() (LLM runs the replicas behind its router)")
        return LLMEngine(config)

    def create_llm(self):
        """An :class:`~atom.llm.LLM` on these arguments. Settings this build cannot honour
        (``model_engine.supported``) are refused before the model is even looked up."""
        from atom.llm import LLM
        from atom.model_engine.supported import unsupported_settings

        kwargs = self._config_kwargs()
        found = unsupported_settings(kwargs)
        if found:
            raise ValueError("; ".join(found))
        model = kwargs.pop("model")
        return LLM(model, dtype=self.dtype, seed=self.seed, **kwargs)
