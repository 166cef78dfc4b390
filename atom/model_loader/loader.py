"""Weights into a model: from a folder of safetensors, or dummy values (`load_dummy`).

Checkpoint names are first renamed by the model's `checkpoint_renames` (name fragments,
e.g. Mixtral's `.block_sparse_moe.` -> `.mlp.`), then mapped through its
`expert_params_mapping` (regexes from `FusedMoE.checkpoint_mapping`: a per-expert
`...experts.3.gate_proj.weight` -> `...experts.w13_weight`, shard (3, "w1"); a fused 3-D
`...experts.gate_up_proj` -> shard (None, "w13")) and its `packed_modules_mapping`
(`...q_proj.weight` -> `...qkv_proj.weight`, shard "q"), and copied by the parameter's
`weight_loader`; plain parameters are copied as they are; per-layer FP8 KV-cache scales
(`self_attn.k_scale`, `k_proj.output_scale`, ...) go to the attention layers (`kv_scales`).
Every parameter must be
written exactly once (tied ones excepted), and every module with `missing_shards()` (a MoE
layer: each expert's parts) must report none, or loading fails naming what is missing. A model
may name checkpoint tensors it does not run (`skip_checkpoint_tensor(name) -> bool`).
"""
from __future__ import annotations

import glob
import logging
import math
import os

import torch
from safetensors import safe_open
from torch import nn

from atom.model_loader.kv_scales import attention_index, load_kv_scale, log_kv_scales

logger = logging.getLogger(__name__)

DUMMY_MODES = (None, "empty", "zero", "xavier")


def _target(name: str, packed: dict, experts=()) -> tuple[str, object]:
    for pattern, dst, part in experts:
        m = pattern.search(name)
        if m:
            expert = m.groupdict().get("expert")
            return name[:m.start()] + dst, (None if expert is None else int(expert), part)
    for src, (dst, shard) in packed.items():
        if f".{src}." in name:
            return name.replace(f".{src}.", f".{dst}."), shard
    return name, None


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_stored_dtype(name: str, target: str, param: nn.Parameter, tensor: torch.Tensor) -> None:
    """A parameter that holds codes (fp8, int8, packed int4 words, e8m0 / fp4 bytes) takes only
    codes: a checkpoint tensor in a 16/32-bit float there would be rounded or truncated by the
    copy into wrong weights without an error (an uncompressed or fake-quantized export of a
    quantized model, or a config naming the wrong layers). ValueError naming both."""
    if param.dtype not in _FLOATS and tensor.dtype in _FLOATS:
        raise ValueError(
            f"checkpoint tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, but {target} "
            f"stores {str(param.dtype).removeprefix('torch.')} codes for its quantization method: the "
            "checkpoint is not stored in the format its quantization_config declares for this layer (an "
            "uncompressed / 'dense' export loads through online quantization of an unquantized config)")


def load_weights(model: nn.Module, path: str) -> None:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model={path!r} has no *.safetensors files: give a folder with weights, "
                         "or use load_dummy")
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    renames = getattr(model, "checkpoint_renames", {})
    experts = getattr(model, "expert_params_mapping", ())
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    skip = getattr(model, "skip_checkpoint_tensor", None)  # e.g. DeepSeek-V3's multi-token-prediction layers
    kv_index = attention_index(model)  # where FP8 KV-cache scales go
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                if "rotary_emb.inv_freq" in name or (skip is not None and skip(name)):
                    continue
                if tied and name == "lm_head.weight":
                    continue  # tied to the embedding, which the checkpoint also holds
                target, shard = _target(_renamed(name, renames), packed, experts)
                param = params.get(target)
                if param is None and load_kv_scale(kv_index, name, lambda: st.get_tensor(name)):
                    continue
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} in {f} has no place in "
                                     f"{type(model).__name__}")
                tensor = st.get_tensor(name)
                check_stored_dtype(name, target, param, tensor)
                loader = getattr(param, "weight_loader", None)
                if loader is not None:
                    loader(param, tensor, shard)
                else:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                         f"model shape {tuple(param.shape)}")
                    param.data.copy_(tensor)
                loaded.add(f"{target}#{shard}")
    log_kv_scales(kv_index)
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
    missing = sorted(n for n in expected if not any(k.split("#")[0] == n for k in loaded))
    missing += [s for m in model.modules() if hasattr(m, "missing_shards") for s in m.missing_shards()]
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:5]}")


def _renamed(name: str, renames: dict) -> str:
    for src, dst in renames.items():
        name = name.replace(src, dst)
    return name


# Dummy quantized values: the spread of the stored codes, so that a scale of
# xavier_std / code_std gives the dequantized weight the bf16 xavier std.
FP8_CODE_STD = 64.0                 # e4m3 codes ~ N(0, 64), clamped to +-448
INT8_CODE_STD = 32.0                # int8 codes round(N(0, 32)), clamped to +-127
INT4_CODE_STD = (280 / 16) ** 0.5   # random nibbles, 0 (q = -8) moved to 8 (q = 0): q in [-7, 7], mean 0
FP4_CODE_STD = (68.5 / 8) ** 0.5    # random e2m1 codes: the 16 values, mean 0
DUMMY_INPUT_SCALE = 16.0 / 448.0    # static activation scales: |x| up to 16 fits the fp8 range
_CODE_STD = {torch.float8_e4m3fn: FP8_CODE_STD, torch.int8: INT8_CODE_STD, torch.int32: INT4_CODE_STD,
             torch.uint8: FP4_CODE_STD}
_PACK = {torch.int32: 8, torch.uint8: 2}  # input values per stored element (int4 pack-quantized, fp4x2)
_ROWS = 4096  # rows generated at once: keeps memory flat on large layers


def _xavier_std(shape, pack: int = 1) -> float:
    """xavier-normal std of one [out, in] matrix (the last two dims; stacked experts: each
    expert's own fans), `pack` input values per stored element."""
    fan_in, fan_out = shape[-1] * pack, shape[-2]
    return (2.0 / (fan_in + fan_out)) ** 0.5


def _companion(module: nn.Module, name: str):
    """The value tensor a scale parameter `name` scales (`weight_scale` -> `weight` or
    `weight_packed`, `w13_weight_scale` -> `w13_weight`)."""
    local = name.rsplit(".", 1)[-1]
    stem = local[:local.rindex("_scale")]
    for cand in (stem, stem + "_packed"):
        p = getattr(module, cand, None)
        if isinstance(p, torch.Tensor) and p.dim() >= 2:
            return p
    return None


def _random_nibbles(shape, gen, device) -> torch.Tensor:
    """int32 words of 8 random 4-bit values, each in 1..15 or 8 (stored q + 8: q in [-7, 7])."""
    w = torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32, generator=gen, device=device)
    for i in range(8):
        zero = ((w >> (4 * i)) & 0xF) == 0
        bit = 1 << (4 * i + 3)
        w |= zero.to(torch.int32) * (bit - 2 ** 32 if bit >= 2 ** 31 else bit)  # bit 31 as int32: -2^31
    return w


def dummy_fill(module: nn.Module, name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    """Dummy values of the parameter `name` of `module`, by its role and dtype, such that
    every layer, quantized or not, computes with weights of the bf16 xavier std:

    - norms ("norm" in the name): 1; biases (also stacked experts' [E, out]) and other 1-D
      float parameters: 0;
    - float weights (>= 2-D): xavier normal over the last two dims (stacked experts [E, out,
      in]: each expert's own fans);
    - quantized values: float8_e4m3fn codes ~ N(0, 64) clamped to +-448; int8
      round(N(0, 32)) clamped to +-127; int32 packed int4 (pack-quantized, 8 per word)
      random nibbles in 1..15 or 8 (q = nibble - 8 symmetric around 0); uint8 packed fp4
      (two e2m1 codes per byte) random bytes;
    - scales (`*_scale`, `*_scale_inv`, per tensor, channel, block or group alike): positive,
      xavier_std / code_std of the tensor they scale (the same xavier std as its bf16
      counterpart); uint8 scales are E8M0 exponents: 127 + round(log2(xavier_std / code_std));
    - `input_scale` (static activation scales): 16 / 448;
    - zero points (`*zero_point`): 0, stored as the producers do (int32: nibbles of 8);
    - int64 parameters (metadata such as int4 `weight_shape`) are never dummies: they carry
      `keep_on_dummy` and are skipped before this is called.
    """
    dev, dt = p.device, p.dtype
    if name.endswith("input_scale"):
        p.data.fill_(DUMMY_INPUT_SCALE)
    elif name.endswith("zero_point"):
        p.data.fill_(-2004318072 if dt == torch.int32 else 0)  # 0x88888888: every nibble 8 (zero point 0)
    elif name.endswith("_scale") or name.endswith("_scale_inv"):
        values = _companion(module, name)
        if values is None:
            raise ValueError(f"dummy weights: no values for the scale {name!r} of {type(module).__name__}")
        std = _xavier_std(values.shape, _PACK.get(values.dtype, 1)) / _CODE_STD.get(values.dtype, 1.0)
        if dt == torch.uint8:  # E8M0
            p.data.fill_(int(min(254, max(0, 127 + round(math.log2(std))))))
        else:
            p.data.fill_(std)
    elif dt in (torch.float8_e4m3fn, torch.int8, torch.int32, torch.uint8):
        for start in range(0, p.shape[0], _ROWS):
            rows = p.data[start:start + _ROWS]
            if dt == torch.float8_e4m3fn:
                r = (torch.randn(rows.shape, generator=gen, device=dev) * FP8_CODE_STD).clamp_(-448, 448)
            elif dt == torch.int8:
                r = (torch.randn(rows.shape, generator=gen, device=dev) * INT8_CODE_STD).round_().clamp_(-127, 127)
            elif dt == torch.int32:
                r = _random_nibbles(rows.shape, gen, dev)
            else:
                r = torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=gen, device=dev)
            rows.copy_(r)
    elif (role := float_dummy_role(name, p)) == "one":
        p.data.fill_(1.0)
    elif role == "xavier":
        std = _xavier_std(p.shape)
        for start in range(0, p.shape[0], 8192):  # chunks of rows keep memory flat
            rows = p.data[start:start + 8192]
            rows.copy_(torch.randn(rows.shape, generator=gen, device=dev) * std)
    else:
        p.data.zero_()


def float_dummy_role(name: str, p: torch.Tensor) -> str:
    """The dummy rule for a float parameter: "one" for norms, "zero" for biases (stacked
    experts' [E, out] too) and other 1-D ones, "xavier" for matrices (the last two dims)."""
    if "norm" in name:
        return "one"
    if name.endswith("bias") or p.dim() < 2:
        return "zero"
    return "xavier"


def init_dummy_weights(model: nn.Module, mode: str, dtype: torch.dtype | None = None) -> None:
    """`load_dummy` modes: "empty" leaves memory as allocated, "zero" zeros, "xavier" random
    values by each parameter's role and dtype (`dummy_fill`: quantized values and scales
    valid, every layer at the bf16 xavier std). Parameters marked `keep_on_dummy` (metadata
    a method checks after loading, e.g. int4 `weight_shape`) keep what they were built with.
    `dtype` (the model dtype): float weights built wider (DeepSeek's fp32 gate) get values it
    holds, as they would from a checkpoint saved in it."""
    if mode not in DUMMY_MODES[1:]:
        raise ValueError(f"load_dummy={mode!r} is invalid: choose one of empty, zero, xavier")
    if mode == "empty":
        return
    gens: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue  # tied
            seen.add(id(p))
            if getattr(p, "keep_on_dummy", False):
                continue
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(0))
            if mode == "zero":
                p.data.zero_()
            else:
                full = f"{mod_name}.{pname}" if mod_name else pname
                dummy_fill(module, full, p, gen)
                if (dtype is not None and p.is_floating_point() and p.element_size() > dtype.itemsize
                        and not full.endswith(("_scale", "_scale_inv"))):  # (scales: as the producers store them)
                    p.data.copy_(p.data.to(dtype))
