"""A parameter that stores quantization codes refuses a float checkpoint tensor at load
(a copy would round / truncate it into wrong weights without an error)."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom import LLM
from tiny_quant import make_tiny_fp8_block_model


def test_a_float_tensor_for_an_fp8_weight_is_refused_by_name(tmp_path):
    path = make_tiny_fp8_block_model(tmp_path / "fp8_block")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.0.mlp.down_proj.weight"
    assert tensors[name].dtype == torch.float8_e4m3fn
    LLM(path, enable_log_stats=False, max_model_len=128, num_kvcache_blocks=16)  # loads as written
    tensors[name] = tensors[name].to(torch.bfloat16)  # what an uncompressed export holds
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight' is bfloat16, but "
                                         r"model.layers.0.mlp.down_proj.weight stores float8_e4m3fn codes"):
        LLM(path, enable_log_stats=False, max_model_len=128, num_kvcache_blocks=16)


def test_codes_and_float_scales_pass_the_check():
    from atom.model_loader.loader import check_stored_dtype
    p = lambda dt: torch.nn.Parameter(torch.empty(2, dtype=dt), requires_grad=False)  # noqa: E731
    check_stored_dtype("w", "w", p(torch.float8_e4m3fn), torch.empty(2, dtype=torch.float8_e4m3fn))
    check_stored_dtype("w", "w", p(torch.int32), torch.empty(2, dtype=torch.int32))
    check_stored_dtype("w", "w", p(torch.int8), torch.empty(2, dtype=torch.int32))  # zero points packed wider
    check_stored_dtype("s", "s", p(torch.float32), torch.empty(2, dtype=torch.bfloat16))  # a scale in bf16
    with pytest.raises(ValueError, match="is float32, but w stores int8 codes"):
        check_stored_dtype("w", "w", p(torch.int8), torch.empty(2, dtype=torch.float32))
    with pytest.raises(ValueError, match="is float16, but w stores uint8 codes"):
        check_stored_dtype("w", "w", p(torch.uint8), torch.empty(2, dtype=torch.float16))
