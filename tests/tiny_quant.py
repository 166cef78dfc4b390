"""Tiny models for the quantization tests: an FP8-block (DeepSeek-style) checkpoint of a
tiny Llama, and a way to make one linear layer fragile on purpose."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_model

BLOCK_SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_tiny_fp8_block_model(path, **overrides) -> str:
    """A tiny Llama (in_features multiples of 128) whose decoder projections are stored as
    float8_e4m3fn weights with one `weight_scale_inv` per 128x128 block (amax / 448), and a
    `quantization_config` as HF's fine-grained fp8 writes it."""
    folder = make_tiny_model(path, "llama", **{**BLOCK_SHAPE, **overrides})
    file = os.path.join(folder, "model.safetensors")
    tensors = load_file(file)
    out = {}
    for name, w in tensors.items():
        if name.endswith(".weight") and any(f".{p}." in name for p in PROJ):
            rows, cols = w.shape  # rows may end in a partial block (k/v: 64)
            padded = torch.zeros(-(-rows // 128) * 128, cols)
            padded[:rows] = w.float()
            blocks = padded.reshape(-1, 128, cols // 128, 128)
            s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            q = (blocks / s[:, None, :, None]).clamp(-448, 448).reshape(-1, cols)[:rows].to(torch.float8_e4m3fn)
            out[name], out[name + "_scale_inv"] = q, s
        else:
            out[name] = w
    save_file(out, file)
    cfg_path = os.path.join(folder, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    json.dump(cfg, open(cfg_path, "w"), indent=1)
    return folder


def make_fragile(model, decoder: int, channel: int = 0, outlier: float = 1e6) -> str:
    """Make `model.layers.<decoder>.mlp.down_proj` fragile: gate and up rows `channel` are
    zeroed, so that input column of down_proj is exactly 0, and that column is set to
    `outlier` (which then never reaches the output). Any per-row quantization of down_proj
    has scales ~outlier / qmax and rounds every other weight of the row to ~0.
    Returns the layer's name."""
    mlp = model.model.layers[decoder].mlp
    inter = mlp.down_proj.in_features
    with torch.no_grad():
        mlp.gate_up_proj.weight[channel] = 0
        mlp.gate_up_proj.weight[inter + channel] = 0
        mlp.down_proj.weight[:, channel] = outlier
    return f"model.layers.{decoder}.mlp.down_proj"
