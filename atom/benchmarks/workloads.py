"""Benchmark workloads and model shapes, written in code (nothing is downloaded)."""
from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass

# Model shapes from shared/REFERENCE.md, as HF config dicts.
MODEL_CONFIGS = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=40960, hidden_act="silu", attention_bias=False, torch_dtype="bfloat16",
        bos_token_id=151643, eos_token_id=151645),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, hidden_act="silu", attention_bias=False, torch_dtype="bfloat16",
        bos_token_id=128000, eos_token_id=128009),
    # MLA (no q_lora_rank, latent 512 + 64 rope: 31,104 B/token in bf16) and a MoE of 64 routed
    # experts (top-6, greedy softmax routing) + 2 shared from layer 1; layer 0 dense
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=False, scoring_func="softmax", rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707,
                      "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
        attention_bias=False, torch_dtype="bfloat16", bos_token_id=100000, eos_token_id=100001),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=40960, hidden_act="silu", attention_bias=False,
        use_sliding_window=False, torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, max_position_embeddings=32768, sliding_window=None, hidden_act="silu",
        torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2),
    # 24 layers alternating a 128-token window and full attention, sinks, attention biases; 32
    # experts top-4 of width 2880 with biases and the clamped SwiGLU; YaRN x32 over 4096
    # (KV 49,152 B/token in bf16). The bf16 shape; "-mxfp4" adds the checkpoint's quantization_config
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True, swiglu_limit=7.0,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
        torch_dtype="bfloat16", bos_token_id=199998, eos_token_id=200002, pad_token_id=199999),
}
MODEL_CONFIGS["gpt-oss-20b-mxfp4"] = dict(
    MODEL_CONFIGS["gpt-oss-20b"],
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})


# the benchmarks' compilation cache dir: the GEMM choice kept there is found again by later runs
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "atom")


def producer_ignore(cfg: dict) -> list[str]:
    """The `ignore` list llm-compressor writes for `cfg` with ignore=["lm_head", "re:.*mlp.gate$"]:
    the resolved names of the MoE routers (they stay bf16, as every producer leaves them),
    then the LM head."""
    L = cfg["num_hidden_layers"]
    if cfg.get("n_routed_experts"):  # DeepSeek: the MoE layers from first_k_dense_replace
        sparse = range(cfg.get("first_k_dense_replace", 0) or 0, L)
    elif cfg.get("num_experts") or cfg.get("num_local_experts"):
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = [i for i in range(L) if i not in dense and (i + 1) % step == 0]
    else:
        sparse = []
    mlp = "block_sparse_moe" if cfg.get("model_type") == "mixtral" else "mlp"
    return [f"model.layers.{i}.{mlp}.gate" for i in sparse] + ["lm_head"]


def write_model_config(name: str, folder: str | None = None, quantization: str | None = None) -> str:
    """A folder holding only config.json for `name` (run it with load_dummy); with
    `quantization` (a name of `quant_formats.FORMATS` other than bf16) the config carries that
    format's `quantization_config` block, as the producer writes it."""
    from atom.benchmarks.quant_formats import get_format
    if name not in MODEL_CONFIGS:
        raise ValueError(f"model={name!r} is unknown: choose one of {', '.join(MODEL_CONFIGS)}")
    fmt = get_format(quantization)
    cfg = dict(MODEL_CONFIGS[name])
    block = fmt.quantization_config(ignore=producer_ignore(cfg))
    if block is not None:
        if "quantization_config" in cfg:
            raise ValueError(f"model={name!r} already holds a quantization_config; --quantization={fmt.name!r} "
                             "applies to bf16 model shapes only")
        cfg["quantization_config"] = block
    suffix = "" if block is None else f"-{fmt.name}"
    folder = folder or os.path.join(tempfile.gettempdir(), f"atom-config-{name}{suffix}")
    os.makedirs(folder, exist_ok=True)
    # written whole, then renamed: another process reading the folder's config.json (a second
    # benchmark, a parallel test) sees the old file or the new one, never a half-written one
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".config-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, os.path.join(folder, "config.json"))
    return folder


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def nano_vllm_workload(num_seqs: int = 256, max_input: int = 1024, max_output: int = 1024,
                       seed: int = 0) -> list[Request]:
    """nano-vllm's bench: input and output lengths uniform in [100, max], token ids in
    [0, 10000], Python's `random` seeded with 0 (256 seqs -> 133,966 output tokens)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input))] for _ in range(num_seqs)]
    outs = [rng.randint(100, max_output) for _ in range(num_seqs)]
    return [Request(p, o) for p, o in zip(prompts, outs)]


def long_context_workload(num_seqs: int = 64, input_range: tuple[int, int] = (4096, 8192),
                          output_range: tuple[int, int] = (100, 512), seed: int = 0) -> list[Request]:
    """Long inputs for the KV-cache comparisons (FP8 KV against bf16 KV): input lengths
    uniform in [4096, 8192], outputs in [100, 512], token ids in [0, 10000] (as nano-vllm's),
    Python's `random` seeded with `seed`."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(*input_range))] for _ in range(num_seqs)]
    outs = [rng.randint(*output_range) for _ in range(num_seqs)]
    return [Request(p, o) for p, o in zip(prompts, outs)]


#: `--workload` of the throughput benchmark -> (maker(num_seqs), default number of sequences)
WORKLOADS = {"nano-vllm": (nano_vllm_workload, 256), "long": (long_context_workload, 64)}


def make_workload(name: str, num_seqs: int | None = None) -> list[Request]:
    """The named workload (`WORKLOADS`) with `num_seqs` sequences (None: its default)."""
    if name not in WORKLOADS:
        raise ValueError(f"--workload={name!r} is unknown: choose one of {', '.join(WORKLOADS)}")
    maker, default = WORKLOADS[name]
    return maker(num_seqs or default)


def needed_model_len(requests: list[Request]) -> int:
    """The longest prompt + its output: the max_model_len a workload needs."""
    return max(len(r.prompt_token_ids) + r.max_tokens for r in requests)


def mixed_workload(num_seqs: int, input_range: tuple[int, int], output_range: tuple[int, int],
                   vocab: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randint(10, vocab - 1) for _ in range(rng.randint(*input_range))],
                    rng.randint(*output_range)) for _ in range(num_seqs)]


def prefill_requests(prompt_len: int, count: int, vocab: int) -> list[Request]:
    """`count` prompts of `prompt_len` random tokens (no shared prefix), one output token each:
    a lone request's prefill (`benchmarks.prefill`, its vLLM peer, `scripts/gpu_profile.py`)."""
    return mixed_workload(count, (prompt_len, prompt_len), (1, 1), vocab, seed=prompt_len)


def warmup_workload(requests: list[Request], max_tokens: int = 8) -> list[Request]:
    """A warm-up with the timed run's shapes: the same prompt lengths (so the same prefill
    chunks and the same kernel and GEMM variants, which a fresh machine otherwise compiles
    or loads inside the timed run) and a full first decode batch, but other token ids, so
    that no prompt block is in the prefix cache for the timed run, and few output tokens."""
    return [Request([(t + 1) % 10001 for t in r.prompt_token_ids], min(r.max_tokens, max_tokens))
            for r in requests]
