"""A tiny Qwen3-MoE checkpoint in compressed-tensors' FP8_DYNAMIC layout, written by hand,
and the fake-quantized transformers model that is its reference.

Layout as llm-compressor writes it (../shared/QUANT_PRODUCERS.md): every decoder Linear
(attention, the dense MLP, each expert's `mlp.experts.{e}.{gate,up,down}_proj`) stored as
`weight` float8_e4m3fn [out, in] + `weight_scale` bf16 [out, 1] (amax / 448 per row); the
router `mlp.gate` and `lm_head` stay unquantized and are listed in `ignore` by resolved name;
`quantization_config` is the FP8_DYNAMIC block quoted there (per-token dynamic activations).
The reference is transformers fp32 with the dequantized weights and every such linear's input
fake-quantized per token, the experts one by one on the rows routed to them.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn

_NULL = {"actorder": None, "block_structure": None, "group_size": None, "observer_kwargs": {}, "scale_dtype": None,
         "zp_dtype": None}
FP8_DYNAMIC = {
    "config_groups": {"group_0": {
        "format": "float-quantized",
        "input_activations": {**_NULL, "dynamic": True, "num_bits": 8, "observer": None, "strategy": "token",
                              "symmetric": True, "type": "float"},
        "output_activations": None, "targets": ["Linear"],
        "weights": {**_NULL, "dynamic": False, "num_bits": 8, "observer": "memoryless_minmax", "strategy": "channel",
                    "symmetric": True, "type": "float"}}},
    "format": "float-quantized", "global_compression_ratio": None, "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
    "transform_config": {}, "version": "0.19.0"}


def quant_fp8_channel(w: torch.Tensor) -> dict:
    """compressed-tensors "channel": scale = amax / 448 per output row, stored bf16 [out, 1]."""
    s = (w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448).bfloat16()
    return {"weight": (w.float() / s.float()).clamp(-448, 448).to(FP8), "weight_scale": s}


def quant_fp8_tensor(w: torch.Tensor) -> dict:
    s = (w.float().abs().amax().clamp(min=1e-12) / 448).bfloat16().reshape(1)
    return {"weight": (w.float() / s.float()).clamp(-448, 448).to(FP8), "weight_scale": s}


def dequant(t: dict) -> torch.Tensor:
    return t["weight"].float() * t["weight_scale"].float()


def fq_token(x: torch.Tensor) -> torch.Tensor:
    """Per-token dynamic fp8 fake quant (written out here, independent of atom)."""
    x = x.float()
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return (x / s).clamp(-448, 448).to(FP8).float() * s


def copy_all_but_weights(src: str, dst: str) -> None:
    """Every file of the model folder `src` but its safetensors, into `dst` (made if missing)."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())


def write_fp8_dynamic_checkpoint(src: str, dst: str) -> dict[str, torch.Tensor]:
    """`src` (an fp32 HF Qwen3-MoE folder, per-expert tensors) -> `dst` in FP8_DYNAMIC layout.
    Returns {checkpoint weight name: dequantized fp32 weight}."""
    copy_all_but_weights(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, deq, ignore = {}, {}, []
    for name, t in tensors.items():
        if name.endswith("mlp.gate.weight"):
            ignore.append(name.removesuffix(".weight"))  # the router: resolved names, as llmc writes them
        if name.endswith("_proj.weight") and ".layers." in name:
            q = quant_fp8_channel(t)
            mod = name.removesuffix(".weight")
            out[f"{mod}.weight"], out[f"{mod}.weight_scale"] = q["weight"], q["weight_scale"]
            deq[name] = dequant(q)
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = {**FP8_DYNAMIC, "ignore": ignore + ["lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh)
    return deq


def quant_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> dict:
    """DeepSeek's native fp8: one scale per bn x bk block (amax / 448, partial blocks at the
    edges), stored as `weight_scale_inv` fp32 [ceil(out/bn), ceil(in/bk)]."""
    bn, bk = block
    rows, cols = w.shape
    padded = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
    q = (blocks / s[:, None, :, None]).clamp(-448, 448).reshape(padded.shape)[:rows, :cols].to(FP8)
    return {"weight": q, "weight_scale_inv": s}


def dequant_block(t: dict, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    bn, bk = block
    w = t["weight"].float()
    s = t["weight_scale_inv"].repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)[:, :w.shape[1]]
    return w * s


def fq_group(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Dynamic fp8 fake quant per 1 x `group` slice of each row (DeepSeek's activations)."""
    x = x.float()
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return ((g / s).clamp(-448, 448).to(FP8).float() * s).reshape(x.shape)


def fake_quant_transformers(src: str, deq: dict[str, torch.Tensor], fq=fq_token, weight_only: tuple[str, ...] = ()):
    """transformers fp32 from `src`, every quantized weight replaced by its dequantized value,
    every quantized linear's input fake-quantized by `fq` (per token unless given; experts:
    per expert, on its rows), except modules whose name ends with one of `weight_only`
    (dequantized weight, input as it is)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    mods = dict(model.named_modules())
    experts = {}
    for name, w in deq.items():
        mod = name.removesuffix(".weight")
        if ".mlp.experts." in mod:
            layer, rest = mod.split(".mlp.experts.")
            e, proj = rest.split(".")
            experts.setdefault(f"{layer}.mlp.experts", {})[(int(e), proj)] = w
            continue
        m = mods[mod]
        m.weight.data.copy_(w)
        if not mod.endswith(weight_only or ("\0",)):
            m.forward = lambda x, m=m: F.linear(fq(x), m.weight).to(x.dtype)
    for name, ws in experts.items():
        m = mods[name]
        for e in range(m.num_experts):
            m.gate_up_proj.data[e] = torch.cat([ws[(e, "gate_proj")], ws[(e, "up_proj")]])
            m.down_proj.data[e] = ws[(e, "down_proj")]
        m.forward = lambda h, ids, w, m=m: _experts_fake_quant(m, h, ids, w, fq)
    return model


def _experts_fake_quant(m, hidden, top_k_index, top_k_weights, fq=fq_token):
    out = torch.zeros_like(hidden)
    for e in range(m.num_experts):
        tok, slot = torch.where(top_k_index == e)
        if len(tok) == 0:
            continue
        gate, up = F.linear(fq(hidden[tok]), m.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(fq(m.act_fn(gate) * up), m.down_proj[e])
        out.index_add_(0, tok, (y * top_k_weights[tok, slot, None]).to(out.dtype))
    return out
