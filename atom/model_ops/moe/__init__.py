"""Mixture-of-experts: the layer, its routing, its weight methods and its kernels.

    from atom.model_ops.moe import FusedMoE, TopK
    moe = FusedMoE(num_experts, hidden, width, TopK(num_experts, top_k, renormalize=True), prefix=...)
    y = moe(x, router_logits)

- `router.py`: `TopK` (softmax / sigmoid scoring, renormalisation, grouped choice, scaling;
  or a `select_fn` of a family's own), `check_routing` (errors at build).
- `method.py`: `MoEMethod` (the quantization seam) and `UnquantizedMoEMethod`; `moe_method_for`.
- `fp8_method.py`: `Fp8MoEMethod` (e4m3 experts, per-channel, per-tensor or block scales per
  expert), registered in `MOE_METHODS["fp8"]`.
- `mxfp4_method.py`: `Mxfp4MoEMethod` (MXFP4 experts, weight only, as GPT-OSS stores them),
  registered in `MOE_METHODS["fp4x2"]`.
- `layer.py`: `FusedMoE` (stacked w13 [E, 2I, H] / w2 [E, H, I], loaders, shared experts).
- `experts_ref.py`: the torch reference (a loop over the experts that got tokens, `routed_sum`).
- `experts_triton.py`: the grouped GEMM over pairs sorted by expert, and the unsorted
  small-batch path; `tile_configs.py` + `configs/`: tuned tiles per shape and GPU.
  `experts_fp8_triton.py` / `experts_mxfp4_triton.py`: the same grouped GEMM for FP8 experts
  (e4m3 x e4m3 with their scales) and MXFP4 experts (dequantized in registers);
  `experts_op.py`: the three as torch custom ops for torch.compile.
- `routing_stats.py`: `ExpertLoadRecorder` (tokens per expert per layer per step).
"""
from atom.model_ops.moe.experts_ref import experts_reference, routed_sum
from atom.model_ops.moe.layer import ACTIVATIONS, FusedMoE
from atom.model_ops.moe.method import MOE_METHODS, MoEMethod, UnquantizedMoEMethod, moe_method_for
from atom.model_ops.moe.fp8_method import Fp8MoEMethod  # registers MOE_METHODS["fp8"]
from atom.model_ops.moe.mxfp4_method import Mxfp4MoEMethod  # registers MOE_METHODS["fp4x2"]
from atom.model_ops.moe.router import SCORINGS, TopK, check_routing, topk_select
from atom.model_ops.moe.routing_stats import ExpertLoadRecorder



def describe_moe_layers(model) -> list[dict]:
    """One dict per `FusedMoE` of `model`: layer, experts, top_k, width (this rank's), routing,
    activation, method, format, bytes, kernel (`method.kernel_for(layer)` where the method
    says, else None), route_kernel (`FusedMoE.route_kernel`), shared experts (and how many
    experts of the grouped GEMM they became, 0 where not stacked: `shared_stack`; shared_stream
    "second" where they run beside the routed experts on a GPU, "shared_overlap"), parallel
    ("single" / "tensor" / "expert"), the rank's global expert ids, rank and ranks
    (`atom.viz.moe_layers_frame` makes a DataFrame)."""
    rows = []
    for name, m in model.named_modules():
        if isinstance(m, FusedMoE):
            rows.append({"layer": name, "experts": m.num_experts, "top_k": m.topk.top_k,
                         "width": m.intermediate_size, "routing": m.topk.extra_repr(),
                         "activation": m.activation_name, "method": m.method.name, "format": m.method.format(m),
                         "bytes": m.method.weight_bytes(m),
                         "kernel": m.method.kernel_for(m) if hasattr(m.method, "kernel_for") else None,
                         "route_kernel": m.route_kernel(),
                         "shared_experts": m.shared_experts is not None,
                         "shared_stacked": m.shared_stack[2] if m.shared_stack is not None else 0,
                         "shared_stream": ("second" if m.shared_experts is not None and m.shared_stack is None
                                           and m.plan is not None and m.plan.has("shared_overlap") else None),
                         "parallel": m.parallel_mode, "local_experts": f"[{m.expert_start}, "
                         f"{m.expert_start + m.num_local_experts})", "rank": m.tp.rank, "ranks": m.tp.world_size})
    return rows


__all__ = ["describe_moe_layers", "ACTIVATIONS", "ExpertLoadRecorder", "Fp8MoEMethod", "FusedMoE", "MOE_METHODS", "MoEMethod", "Mxfp4MoEMethod", "SCORINGS", "TopK",
           "UnquantizedMoEMethod", "check_routing", "experts_reference", "moe_method_for", "routed_sum", "topk_select"]
