"""Fusions the runner installs on decoder layers from the engine's kernel plan.

A model's decoder layer reads like the architecture (norm -> attention -> norm -> MLP;
attention = project, rotate, attend, project). On the Triton backend, outside
torch.compile, the runner replaces that forward, layer by layer, with `fused_forward`,
which computes the same thing with fewer kernels where the plan says so:
- "norm+gemv" / "norm+gemv+silu": at batch 1, where the plan chose a Triton GEMV for the
  shape, the RMSNorm before the q/k/v and gate-up projections (and the SiLU-and-mul after
  gate-up) run inside the GEMV (`kernels.gemv_fused`);
- "norm+gemv+rope": at batch 1 without q/k norms (Llama), the q/k/v GEMV also rotates q and
  k and writes k, v into the paged cache (`kernels.gemv_rope`);
- "rope_in_attention": decode steps hand q, k unrotated to the attention kernel, which
  rotates them (after the q/k norms) and writes k, v itself; NVIDIA only (the kernel reads
  what it wrote after a block barrier, not checked on AMD GPUs);
- "rope+kv_write": otherwise the rotary kernel (with the q/k norms) also writes k, v into
  the cache, and the attention op only reads.
A layer matches when it has the Llama-shaped parts (`matches`); others keep their forward.
`uninstall` restores the architecture's forward.
"""
from __future__ import annotations

import logging
import types

import torch
from torch import nn

from atom.model_ops.activation import silu_and_mul
from atom.model_ops.attention import get_forward_context
from atom.model_ops.quant import is_unquantized

logger = logging.getLogger(__name__)


def default_fusions(backend: str) -> tuple[str, ...]:
    """The fusions a backend runs at level 0 (the Triton kernels; AITER shares them)."""
    if backend == "torch":
        return ()
    out = ("norm+gemv", "norm+gemv+silu", "norm+gemv+rope", "rope+kv_write")
    return out + (("rope_in_attention",) if torch.version.hip is None else ())


def matches(layer: nn.Module) -> bool:
    """Whether a decoder layer has the parts `fused_forward` uses."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm"))
            and attn is not None and all(hasattr(attn, n) for n in ("qkv_proj", "o_proj", "rotary_emb", "attn"))
            and mlp is not None and all(hasattr(mlp, n) for n in ("gate_up_proj", "down_proj")))


def install(model: nn.Module, plan) -> int:
    """Install `fused_forward` on every matching decoder layer and declare the one-row
    variants each projection is called with (for the start-up GEMV choice); returns how
    many layers took it. Without fusions in the plan, nothing changes."""
    n = 0
    if not plan.fusions:
        return 0
    for m in model.modules():
        if matches(m):
            attn = m.self_attn
            qk_norm = getattr(attn, "qk_norm", False)
            attn.qkv_proj.one_row = (("norm",) if plan.has("norm+gemv") else ()) + \
                (("norm+rope",) if plan.has("norm+gemv+rope") and not qk_norm else ())
            m.mlp.gate_up_proj.one_row = "norm+silu" if plan.has("norm+gemv+silu") else ()
            m.forward = types.MethodType(fused_forward, m)
            n += 1
    logger.info("fusions %s installed on %d decoder layers", list(plan.fusions), n)
    return n


def uninstall(model: nn.Module) -> None:
    for m in model.modules():
        if "forward" in m.__dict__ and matches(m):
            del m.forward
            m.self_attn.qkv_proj.one_row = "plain"
            m.mlp.gate_up_proj.one_row = "plain"


def norm_linear(norm, linear, x: torch.Tensor, residual: torch.Tensor | None, gated: bool = False):
    """`linear(norm(x + residual))`, then SiLU-and-mul when `gated`; returns (y, x + residual)
    like the norm (no add when `residual` is None: the residual is then x). One row, where the
    plan chose a Triton GEMV for the shape, runs as one fused kernel."""
    plan = linear.plan
    cfg = None
    if plan is not None and linear.bias is None and is_unquantized(linear):
        cfg = plan.one_row_config(x, linear.weight, "norm+silu" if gated else "norm")
    if cfg is not None:
        from atom.model_ops.kernels.gemv import gemv_fused
        return gemv_fused(x, residual, norm.weight, norm.eps, linear.weight, gated, cfg)
    if residual is None:
        h, residual = norm(x), x
    else:
        h, residual = norm(x, residual)
    y = linear(h)
    return (silu_and_mul(y) if gated else y), residual


def norm_linear_rope(norm, linear, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor):
    """One row, where the plan chose it: RMSNorm, the packed q/k/v product, the rotary
    embedding of q and k and the write of k and v into the caches, as one Triton GEMV.
    Returns (qkv with q rotated, x + residual), or None where that does not apply."""
    plan = linear.plan
    cfg = plan.one_row_config(x, linear.weight, "norm+rope") \
        if plan is not None and linear.bias is None and is_unquantized(linear) else None
    if cfg is None:
        return None
    from atom.model_ops.kernels.gemv_rope import gemv_norm_rope
    return gemv_norm_rope(x, residual, norm.weight, norm.eps, linear.weight, linear.head_dim, linear.q_size,
                          positions, cos_sin_cache, k_cache, v_cache, slot_mapping, cfg)


def _attention(attn, plan, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """Rotate, write the cache and attend with the fused kernels; o_proj of the result."""
    q_size, kv_size = attn.qkv_proj.q_size, attn.qkv_proj.kv_size
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    qk_norm = getattr(attn, "qk_norm", False)
    meta = get_forward_context()
    if plan.has("rope_in_attention") and meta.max_query_len == 1:
        # decode: the attention kernel rotates q and k (after the q / k norms) and writes k, v
        rotary = (attn.rotary_emb.cos_sin_cache,) + ((attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
                                                     if qk_norm else ())
        return attn.o_proj(attn.attn(q, k, v, rotary))
    target = attn.attn.backend.cache_target(attn.attn, meta) if plan.has("rope+kv_write") else None
    if target is not None:  # (None: the backend writes this cache itself, e.g. FP8)
        # one kernel: q/k norm, rotary, and this step's k and v into the paged cache
        norms = (attn.q_norm, attn.k_norm) if qk_norm else ()
        attn.rotary_emb(positions, q, k, *norms, kv_cache=(v, *target))
        return attn.o_proj(attn.attn(q, None, None))
    q, k = attn.rotary_emb(positions, q, k, *((attn.q_norm, attn.k_norm) if qk_norm else ()))
    return attn.o_proj(attn.attn(q, k, v))


def fused_forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
    """The decoder layer's forward with the plan's fusions (see the module docstring); falls
    back to the architecture's forward under torch.compile and on the torch backend."""
    attn, mlp = self.self_attn, self.mlp
    plan = attn.qkv_proj.plan
    if plan is None or torch.compiler.is_compiling() or plan.kernels_for(hidden) is None \
            or attn.attn.backend.name != "triton":
        return type(self).forward(self, positions, hidden, residual)
    fused = None
    if plan.has("norm+gemv+rope") and not getattr(attn, "qk_norm", False) and hidden.shape[0] == 1:
        target = attn.attn.backend.cache_target(attn.attn, get_forward_context())
        if target is not None:
            fused = norm_linear_rope(self.input_layernorm, attn.qkv_proj, hidden, residual, positions,
                                     attn.rotary_emb.cos_sin_cache, *target)
    if fused is not None:  # q rotated, k and v in the cache
        qkv, residual = fused
        hidden = attn.o_proj(attn.attn(qkv[:, :attn.qkv_proj.q_size], None, None))
    else:
        qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, hidden, residual)
        hidden = _attention(attn, plan, positions, qkv)
    act, residual = norm_linear(self.post_attention_layernorm, mlp.gate_up_proj, hidden, residual, gated=True)
    return mlp.down_proj(act), residual
