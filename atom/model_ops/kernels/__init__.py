"""Triton kernels of the engine, each next to its torch reference (``*_ref``).

The references run anywhere (CPU included) and define the semantics; the Triton
versions run on GPUs, or on CPU tensors under ``TRITON_INTERPRET=1`` (set it
before this package is imported: triton reads it when the kernels are defined).
"""

from atom.model_ops.kernels.activation import silu_and_mul, silu_and_mul_ref
from atom.model_ops.kernels.kv_cache import reshape_and_cache, reshape_and_cache_ref
from atom.model_ops.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from atom.model_ops.kernels.rotary import rotary_embedding, rotary_embedding_ref
from atom.model_ops.kernels.sampling import gumbel_sample, gumbel_sample_ref
from atom.model_ops.kernels.gemv import gemv, gemv_fused, gemv_fused_ref, gemv_ref

from atom.model_ops.kernels.triton_import import HAS_TRITON

__all__ = [
    "HAS_TRITON",
    "silu_and_mul", "silu_and_mul_ref",
    "reshape_and_cache", "reshape_and_cache_ref",
    "rms_norm", "rms_norm_ref", "fused_add_rms_norm", "fused_add_rms_norm_ref",
    "rotary_embedding", "rotary_embedding_ref",
    "gumbel_sample", "gumbel_sample_ref",
    "gemv", "gemv_ref", "gemv_fused", "gemv_fused_ref",
]
