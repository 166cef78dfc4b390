"""The physical floor of a workload: bytes over HBM bandwidth, FLOPs over peak.

Decode steps are bound by bytes: every step reads the weights once plus the KV of every
active sequence. For a MoE model "the weights" are the dense part plus the experts the step
activates: with B tokens routed uniformly to k of E experts, E * (1 - (1 - k/E)^B) experts per
sparse layer are expected to be read (`ModelCost.step_weight_params`). Prefill is bound by FLOPs (2 x params x tokens, plus attention).
The floor assumes every sequence is admitted at once (the best case for batching).

Quantized formats (`weight_format`, a name of `atom.benchmarks.quant_formats.FORMATS`): the
decoder's linear layers (and MoE experts) are counted at the format's bytes, values plus
scales (fp8 / int8 1 B, int4 / MXFP4 0.5 B, + bf16 or e8m0 scales), each layer at its own
[n, k]; the embeddings, the LM head, norms and MoE routers stay bf16, as the producers leave
them. `kv_cache_dtype="fp8"` counts 1 B per KV element. FP8 / INT8 W8A8 formats get twice
the bf16 FLOP peak for their matmuls (the H200's fp8 / int8 tensor cores).

    python -m atom.benchmarks.roofline --model qwen3-0.6b [--bandwidth 4.3e12 --flops 790e12]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from atom.benchmarks.quant_formats import FORMATS, get_format
from atom.benchmarks.workloads import MODEL_CONFIGS, nano_vllm_workload

H200_BANDWIDTH = 4.3e12   # B/s, device-to-device copy measured on the lent H200
H200_BF16_FLOPS = 790e12  # FLOP/s, 8192^3 bf16 GEMM measured there


@dataclass
class ModelCost:
    params: int              # all weights read per step (embedding counted once if tied)
    matmul_params: int       # weights multiplied per token (incl. the lm head)
    kv_bytes_per_token: int
    layers: int
    q_heads: int
    head_dim: int
    moe_layers: int = 0      # sparse layers (their experts are not in params / matmul_params)
    experts: int = 0
    top_k: int = 0
    expert_params: int = 0   # one expert's gate, up and down
    weight_bytes: float = 0.0         # bytes of the weights in `params` (0: params x the dtype's bytes)
    expert_weight_bytes: float = 0.0  # bytes of one expert (0: expert_params x the dtype's bytes)
    matmul_peak: float = 1.0          # the weight format's matmul peak over bf16's

    def step_weight_bytes(self, tokens: int, dtype_bytes: int = 2) -> float:
        """Bytes one step of `tokens` tokens reads from the weights (`step_weight_params`
        at the format's bytes)."""
        dense = self.weight_bytes or self.params * dtype_bytes
        if not self.moe_layers:
            return dense
        expert = self.expert_weight_bytes or self.expert_params * dtype_bytes
        active = self.experts * (1 - (1 - self.top_k / self.experts) ** max(tokens, 0))
        return dense + self.moe_layers * active * expert

    def step_weight_params(self, tokens: int) -> float:
        """Weights one step of `tokens` tokens reads: the dense ones and the expected
        activated experts (uniform routing)."""
        if not self.moe_layers:
            return self.params
        active = self.experts * (1 - (1 - self.top_k / self.experts) ** max(tokens, 0))
        return self.params + self.moe_layers * active * self.expert_params

    def token_matmul_params(self) -> int:
        return self.matmul_params + self.moe_layers * self.top_k * self.expert_params


def _moe_shape(cfg: dict) -> tuple[int, int, int, int, set[int]]:
    """(experts, top_k, width, router rows, sparse layer indices) of a Qwen3-MoE / Mixtral config."""
    E = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if not E:
        return 0, 0, 0, 0, set()
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = {i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0}
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return E, cfg["num_experts_per_tok"], width, E, sparse


def deepseek_cost(cfg: dict, dtype_bytes: int = 2, weight_format: str | None = None,
                  kv_bytes: float | None = None) -> ModelCost:
    """MLA + MoE (DeepSeek-V2/V3): KV is one latent (kv_lora_rank + rope dims) per token and
    layer; a step reads the attention and dense layers, the shared experts and routers of
    each MoE layer, and the routed experts its tokens activate (uniform routing, as for the
    other MoE families: `ModelCost.step_weight_bytes`)."""
    h, L, H = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    nope, rope, v, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    q_rank = cfg.get("q_lora_rank")
    q = h * q_rank + q_rank * H * (nope + rope) if q_rank else h * H * (nope + rope)
    attn = q + h * (r + rope) + r * H * (nope + v) + H * v * h
    dense = cfg.get("first_k_dense_replace", 0) or 0
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    expert = 3 * h * cfg["moe_intermediate_size"]
    always = (cfg.get("n_shared_experts") or 0) * expert + h * E  # shared experts + router, every MoE layer
    body = L * attn + dense * 3 * h * cfg["intermediate_size"] + (L - dense) * always
    embed = cfg["vocab_size"] * h
    read = body + embed * (1 if cfg.get("tie_word_embeddings", False) else 2)
    fmt = get_format(weight_format)
    per_param = fmt.weight_bytes(128, h) / (128 * h)  # linears at the format's bytes (scales as for K = hidden)
    wbytes = (body * per_param + (read - body) * dtype_bytes) if fmt.weights is not None else 0.0
    ebytes = expert * per_param if fmt.weights is not None else 0.0
    return ModelCost(read, body + embed, int(L * (r + rope) * (kv_bytes or dtype_bytes)), L, H, nope + rope,
                     L - dense, E, k, expert, weight_bytes=wbytes, expert_weight_bytes=ebytes,
                     matmul_peak=fmt.matmul_peak)


def _kv_bytes(kv_cache_dtype: str | None, dtype_bytes: int) -> float:
    if kv_cache_dtype in (None, "auto", "bf16"):
        return dtype_bytes
    if kv_cache_dtype == "fp8":
        return 1
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is unknown: choose one of auto, bf16, fp8")


def model_cost(cfg: dict, dtype_bytes: int = 2, weight_format: str | None = None,
               kv_cache_dtype: str | None = None) -> ModelCost:
    """Parameters, bytes and KV size of a model config; `weight_format` a name of
    `quant_formats.FORMATS` (None: the dtype's), `kv_cache_dtype` auto / bf16 / fp8."""
    kv = _kv_bytes(kv_cache_dtype, dtype_bytes)
    if "kv_lora_rank" in cfg:
        return deepseek_cost(cfg, dtype_bytes, weight_format, kv)
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    E, k, width, router, sparse = _moe_shape(cfg)
    attn = h * (hq + 2 * hkv) * d + hq * d * h
    body = L * attn + (L - len(sparse)) * 3 * h * i + len(sparse) * router * h
    embed = cfg["vocab_size"] * h
    tied = cfg.get("tie_word_embeddings", False)
    read = body + embed * (1 if tied else 2)
    fmt = get_format(weight_format)
    wbytes = ebytes = 0.0
    if fmt.weights is not None:  # linears at the format's bytes; embeddings, LM head, routers in the dtype
        dense_layers = L - len(sparse)
        lin = L * (fmt.weight_bytes((hq + 2 * hkv) * d, h) + fmt.weight_bytes(h, hq * d))
        lin += dense_layers * (fmt.weight_bytes(2 * i, h) + fmt.weight_bytes(h, i))
        wbytes = lin + (len(sparse) * router * h + embed * (1 if tied else 2)) * dtype_bytes
        if E:
            ebytes = fmt.weight_bytes(2 * width, h) + fmt.weight_bytes(h, width)
    return ModelCost(read, body + embed, int(2 * L * hkv * d * kv), L, hq, d,
                     len(sparse), E, k, 3 * h * width if E else 0, wbytes, ebytes, fmt.matmul_peak)


@dataclass
class Floor:
    seconds: float
    decode_seconds: float
    prefill_seconds: float
    output_tokens: int
    tokens_per_s: float


def workload_floor(cfg: dict, prompt_lens: list[int], output_lens: list[int], dtype_bytes: int = 2,
                   bandwidth: float = H200_BANDWIDTH, flops: float = H200_BF16_FLOPS,
                   weight_format: str | None = None, kv_cache_dtype: str | None = None) -> Floor:
    c = model_cost(cfg, dtype_bytes, weight_format, kv_cache_dtype)
    # prefill: linear FLOPs (at the format's peak) + causal attention FLOPs (QK^T and PV:
    # 2 * 2 * n^2/2 * heads * d, in bf16)
    lin = sum(2 * c.token_matmul_params() * n for n in prompt_lens)
    att = sum(2 * c.layers * c.q_heads * c.head_dim * n * n for n in prompt_lens)
    prefill_s = lin / (flops * c.matmul_peak) + att / flops
    # decode: step t reads the weights and the KV of every sequence still running
    decode_s = 0.0
    steps = max(output_lens)
    alive = sorted(zip(output_lens, prompt_lens))
    for t in range(1, steps):
        alive = [(o, p) for o, p in alive if o > t]
        kv = sum(p + t for _, p in alive) * c.kv_bytes_per_token
        step_flops = 2 * c.token_matmul_params() * len(alive)
        decode_s += max((c.step_weight_bytes(len(alive), dtype_bytes) + kv) / bandwidth,
                        step_flops / (flops * c.matmul_peak))
    total = prefill_s + decode_s
    out = sum(output_lens)
    return Floor(total, decode_s, prefill_s, out, out / total)


def prefill_floor_ms(cfg: dict, tokens: int, dtype_bytes: int = 2, bandwidth: float = H200_BANDWIDTH,
                     flops: float = H200_BF16_FLOPS, weight_format: str | None = None) -> float:
    """Lower bound of one request's prefill of `tokens` tokens (a step of its own): its
    FLOPs at the peak, or the weights it activates read once, whichever takes longer. The
    LM head runs on the one row that samples; an untied embedding table is not read whole
    (a lookup of `tokens` rows)."""
    c = model_cost(cfg, dtype_bytes, weight_format)
    head = cfg["vocab_size"] * cfg["hidden_size"]
    compute = (2 * ((c.token_matmul_params() - head) * tokens + head) / (flops * c.matmul_peak)
               + 2 * c.layers * c.q_heads * c.head_dim * tokens * tokens / flops)
    read = c.step_weight_bytes(tokens, dtype_bytes)
    if not cfg.get("tie_word_embeddings", False):
        read -= head * dtype_bytes
    return max(compute, read / bandwidth) * 1e3


def decode_floor_ms(cfg: dict, batch: int, context: int, dtype_bytes: int = 2,
                    bandwidth: float = H200_BANDWIDTH, weight_format: str | None = None,
                    kv_cache_dtype: str | None = None) -> float:
    """Lower bound of one decode step's time at `batch` sequences of `context` tokens."""
    c = model_cost(cfg, dtype_bytes, weight_format, kv_cache_dtype)
    return (c.step_weight_bytes(batch, dtype_bytes) + batch * context * c.kv_bytes_per_token) / bandwidth * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_CONFIGS))
    ap.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH)
    ap.add_argument("--flops", type=float, default=H200_BF16_FLOPS)
    ap.add_argument("--quantization", default="bf16", choices=list(FORMATS), help="weight format")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--out", help="write JSON here")
    args = ap.parse_args(argv)
    fmt = get_format(args.quantization).name
    w = nano_vllm_workload()
    cfg = MODEL_CONFIGS[args.model]
    f = workload_floor(cfg, [len(r.prompt_token_ids) for r in w], [r.max_tokens for r in w],
                       bandwidth=args.bandwidth, flops=args.flops, weight_format=fmt, kv_cache_dtype=args.kv_cache_dtype)
    c = model_cost(cfg, weight_format=fmt, kv_cache_dtype=args.kv_cache_dtype)
    one = decode_floor_ms(cfg, 1, 640, weight_format=fmt, kv_cache_dtype=args.kv_cache_dtype)
    from rich.console import Console
    Console().print(f"[bold]{args.model}[/] ({fmt}, KV {args.kv_cache_dtype}) weights {c.params / 1e9:.2f} B params = "
                    f"{c.step_weight_bytes(1) / 1e9:.2f} GB, KV {c.kv_bytes_per_token / 1024:.0f} KiB/token\n"
                    f"nano-vllm workload floor: {f.seconds:.2f} s = {f.tokens_per_s:,.0f} tok/s "
                    f"(decode {f.decode_seconds:.2f} s, prefill {f.prefill_seconds:.2f} s)\n"
                    f"batch-1 decode floor at 640 tokens of context: {one:.3f} ms/token")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"model": args.model, "quantization": fmt, "kv_cache_dtype": args.kv_cache_dtype,
                       "decode_floor_ms_b1_640": one, **asdict(f)}, fh, indent=1)


if __name__ == "__main__":
    main()
