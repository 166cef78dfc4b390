"""Mixture-of-experts: the layer, its routing, its weight methods and its kernels.

    from atom.model_ops.moe import FusedMoE, TopK
    moe = FusedMoE(num_experts, hidden, width, TopK(num_experts, top_k, renormalize=True), prefix=...)
    y = moe(x, router_logits)

- `router.py`: `TopK` (softmax / sigmoid scoring, renormalisation, grouped choice, scaling;
  or a `select_fn` of a family's own), `check_routing` (errors at build).
- `method.py`: `MoEMethod` (the quantization seam) and `UnquantizedMoEMethod`; `moe_method_for`.
- `layer.py`: `FusedMoE` (stacked w13 [E, 2I, H] / w2 [E, H, I], loaders, shared experts).
- `experts_ref.py`: the torch reference (a loop over the experts that got tokens).
- `experts_triton.py`: the grouped GEMM over pairs sorted by expert, and the unsorted
  small-batch path; `tile_configs.py` + `configs/`: tuned tiles per shape and GPU.
- `routing_stats.py`: `ExpertLoadRecorder` (tokens per expert per layer per step).
"""
from atom.model_ops.moe.experts_ref import experts_reference
from atom.model_ops.moe.layer import ACTIVATIONS, FusedMoE
from atom.model_ops.moe.method import MOE_METHODS, MoEMethod, UnquantizedMoEMethod, moe_method_for
from atom.model_ops.moe.router import SCORINGS, TopK, check_routing, topk_select
from atom.model_ops.moe.routing_stats import ExpertLoadRecorder

__all__ = ["ACTIVATIONS", "ExpertLoadRecorder", "FusedMoE", "MOE_METHODS", "MoEMethod", "SCORINGS", "TopK",
           "UnquantizedMoEMethod", "check_routing", "experts_reference", "moe_method_for", "topk_select"]
