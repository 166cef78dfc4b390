"""`FusedMoE`: a mixture-of-experts layer with stacked expert weights.

    moe = FusedMoE(num_experts=8, hidden_size=64, intermediate_size=32,
                   topk=TopK(8, 2, renormalize=True), prefix="model.layers.0.mlp.experts")
    y = moe(x, router_logits)          # x [T, H], router_logits [T, E] (the model's gate)

Router logits in, the `TopK` choice (pluggable), the experts through the layer's `MoEMethod`
(from the quantization config; the method holds the weights and picks the kernel the
engine's `KernelPlan` chose), plus optional shared experts added to the routed sum: a module
on x (registered here, as `shared_experts`), or a callable on x such as the bound `forward`
of a module the model keeps under its own checkpoint name (DeepSeek's `mlp.shared_experts`). `activation` maps the [n, 2I] gate-up output to [n, I]: a name ("silu") or a
callable, so a family with its own gated activation passes it in.

Loading: each stacked parameter has `weight_loader(param, tensor, (expert_id, part))`; a
per-expert tensor fills one expert's rows of one part ("w1" gate, "w3" up, "w2" down), a
fused 3-D tensor (expert_id None) fills every expert, part "w13" meaning all parts of w13 in
order. A part may carry layout tags after "+" for checkpoints that store experts otherwise
(`LAYOUTS`, applied in this order): "transposed" (the last two dims are [in, out], as
GPT-OSS's `gate_up_proj` [E, H, 2I]), "blocks" (packed values as [..., K/32, 16] blocks,
flattened to [..., K/2]: GPT-OSS's MXFP4 `*_blocks`), "interleaved" (gate and up rows
alternate, gate first: GPT-OSS; de-interleaved into [gate | up]); e.g. "w13+transposed+interleaved". `checkpoint_mapping()` gives the regexes a model lists as `expert_params_mapping`
for the loader. `missing_shards()` names what the checkpoint did not fill.

Parallel (`layer.tp`, the `ParallelState` it was built under; the router stays replicated):
- tensor parallel: every rank holds every expert, a slice of its width: w13 rank r's rows
  [r I/tp, (r+1) I/tp) of the gate and of the up part, w2 the same columns. The loader
  narrows each checkpoint tensor along the dim its parameter declares (`output_dim` /
  `input_dim`), per part.
- expert parallel (`tp.expert_parallel`): rank r holds the whole width of experts
  `tp.expert_range(E)` (global ids [start, start + num_local_experts)); the loader skips
  other experts' tensors and takes the rank's block of a fused 3-D one. The tokens are
  already on every rank (the attention before is tensor-parallel, its output replicated), so
  dispatch is local: the (token, expert) pairs of other ranks' experts get weight 0 (their id
  mapped to local expert 0), and the combine is the sum below.
- DP attention (`tp.moe_group`, the replicas' group; `layer.tp` is then that group): each
  replica brings its own tokens; they are gathered across the replicas, every rank runs its
  experts (or width slice) on all of them, and the summed rows go back to their replica.
Either way each rank's output is a partial sum, all-reduced once, shared experts included
when their down projection leaves its sum to this layer (`RowParallelLinear(...,
reduce_results=False)`; a module that reduces itself is added after the reduce). Routing
statistics record the global ids before any of this, so they count every expert.
"""
from __future__ import annotations

import functools
import re
from typing import Callable

import torch
from torch import nn

from atom.distributed.state import current_parallel_state
from atom.model_ops.activation import silu_and_mul
from atom.model_ops.moe.method import MoEMethod, moe_method_for
from atom.model_ops.moe.route_triton import fused_topk, fused_topk_fits
from atom.model_ops.moe.router import TopK
from atom.model_ops.activation import gpt_oss_swiglu

ACTIVATIONS: dict[str, Callable[..., torch.Tensor]] = {"silu": silu_and_mul, "gpt_oss_swiglu": gpt_oss_swiglu}
#: activations whose name may carry float keyword arguments, "gpt_oss_swiglu(alpha=1.702,limit=7.0)"
PARAMETERS: dict[str, tuple[str, ...]] = {"gpt_oss_swiglu": ("alpha", "limit")}
LAYOUTS = ("transposed", "blocks", "interleaved")


def activation_name(name: str, **params: float) -> str:
    """The string form of a parametrised activation (what the experts op receives)."""
    return f"{name}({','.join(f'{k}={float(v)!r}' for k, v in params.items())})" if params else name


def activation_of(activation: str | Callable) -> Callable:
    """The gated activation of a name ("silu", "gpt_oss_swiglu(alpha=..,limit=..)") or a callable."""
    if callable(activation):
        return activation
    base, _, args = activation.partition("(")
    if base not in ACTIVATIONS:
        raise ValueError(f"hidden_act={activation!r} has no gated MoE activation here: choose one of "
                         f"{', '.join(ACTIVATIONS)} or pass a callable")
    if not args:
        return ACTIVATIONS[base]
    kw = {}
    for item in args.rstrip(")").split(","):
        key, _, value = item.partition("=")
        if key.strip() not in PARAMETERS.get(base, ()):
            raise ValueError(f"activation {activation!r}: {key.strip()!r} is not a parameter of {base} "
                             f"(it takes {', '.join(PARAMETERS.get(base, ())) or 'none'})")
        kw[key.strip()] = float(value)
    return functools.partial(ACTIVATIONS[base], **kw)


def relayout(loaded: torch.Tensor, tags: list[str], per_expert: bool) -> torch.Tensor:
    """A checkpoint tensor in the layer's layout (see `LAYOUTS` in the module docstring)."""
    for tag in tags:
        if tag not in LAYOUTS:
            raise ValueError(f"checkpoint layout tag {tag!r} is unknown: choose from {', '.join(LAYOUTS)}")
    if "transposed" in tags:
        loaded = loaded.transpose(-1, -2)
    if "blocks" in tags:
        loaded = loaded.flatten(-2)
    if "interleaved" in tags:
        dim = 0 if per_expert else 1
        pairs = loaded.unflatten(dim, (-1, 2))  # [..., I, 2, ...]: (gate, up) of each row pair
        loaded = torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim)
    return loaded


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, topk: TopK,
                 activation: str | Callable = "silu", bias: bool = False, shared_experts: nn.Module | Callable | None = None,
                 quant_config=None, prefix: str = "", layer_idx: int | None = None):
        super().__init__()
        if topk.num_experts != num_experts:
            raise ValueError(f"{prefix}: the router picks among {topk.num_experts} experts but the layer has "
                             f"{num_experts}")
        self.prefix, self.layer_idx = prefix, layer_idx
        self.tp = current_parallel_state()
        self.gather_tokens = self.tp.moe_group is not None  # DP attention: the layer spans every replica
        if self.gather_tokens:
            self.tp = self.tp.moe_group
        self.parallel_mode = ("single" if self.tp.world_size == 1 else
                              "expert" if self.tp.expert_parallel else "tensor")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.full_intermediate_size = intermediate_size
        self.expert_start, self.num_local_experts = 0, num_experts
        if self.parallel_mode == "expert":
            self.expert_start, self.num_local_experts = self.tp.expert_range(num_experts, prefix)
        elif self.parallel_mode == "tensor":
            intermediate_size = self.tp.split(intermediate_size, f"{prefix} moe intermediate_size")
        self.intermediate_size = intermediate_size  # this rank's width of each expert
        self.topk = topk
        self.activation = activation_of(activation)
        self.activation_has_name = isinstance(activation, str)
        self.activation_name = activation if isinstance(activation, str) else getattr(activation, "__name__", "custom")
        self.act_dtype = torch.get_default_dtype()  # the model's dtype while it is built (the runner sets it)
        self.shared_experts = shared_experts
        self.shared_stack = None  # (w13 [E+S, 2I, H], w2 [E+S, H, I], S): "moe+shared" (`shared_stack`)
        self.plan = None       # the engine's KernelPlan (set by the runner)
        self.tiles = None      # this shape's TileTable from the plan (plan_installed)
        self.tiles_json = ""
        self.recorder = None   # an ExpertLoadRecorder while routing statistics are on
        self.expert_parts: dict[str, tuple[str, ...]] = {}
        self._filled: dict[str, set] = {}
        self.method: MoEMethod = moe_method_for(quant_config, prefix)
        self.method.create_weights(self, self.num_local_experts, hidden_size, intermediate_size, bias)
        if self.parallel_mode == "tensor":
            for name in self.expert_parts:
                p = getattr(self, name)
                if not hasattr(p, "output_dim") and not hasattr(p, "input_dim"):
                    raise NotImplementedError(
                        f"{prefix}.{name}: the {self.method.name} MoE method does not declare how it shards "
                        f"(output_dim / input_dim), so it cannot run with tensor_parallel_size={self.tp.world_size}; "
                        "enable_expert_parallel splits whole experts instead")
        # a module, or a bound method of one (DeepSeek hands its MLP's forward)
        owner = getattr(shared_experts, "__self__", shared_experts)
        self.shared_partial = isinstance(owner, nn.Module) and any(
            getattr(m, "tp_mode", None) == "row" and not getattr(m, "reduce_results", True)
            for m in owner.modules())

    # --- parameters and loading ---------------------------------------------------------
    def add_expert_param(self, name: str, tensor: torch.Tensor, parts: tuple[str, ...], **shards) -> nn.Parameter:
        """Register a stacked per-expert parameter [E_local, ...] whose dim 1 splits equally
        into `parts` (in order); it gets this layer's weight_loader. `shards` (output_dim,
        input_dim, rows_per_entry, input_pack, added_once) say how it splits under tensor
        parallel (module docstring) and become attributes of the parameter."""
        E = self.num_local_experts
        if tensor.shape[0] != E or (len(parts) > 1 and tensor.shape[1] % len(parts)):
            raise ValueError(f"{self.prefix}.{name}: shape {tuple(tensor.shape)} is not [E={E}, "
                             f"{len(parts)} x rows, ...]")
        p = nn.Parameter(tensor, requires_grad=False)
        p.weight_loader = self.weight_loader
        p.expert_param = name
        for key, value in shards.items():
            setattr(p, key, value)
        self.register_parameter(name, p)
        self.expert_parts[name] = tuple(parts)
        self._filled[name] = set()
        return p

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        name = param.expert_param
        parts = self.expert_parts[name]
        expert, part = shard
        part, *tags = part.split("+")
        if tags:
            loaded = relayout(loaded, tags, expert is not None)
        if part == "w13" or (len(parts) == 1 and part == parts[0]):
            which, rows = list(parts), slice(None)
        elif part in parts:
            size = param.shape[1] // len(parts)
            i = parts.index(part)
            which, rows = [part], slice(i * size, (i + 1) * size)
        else:
            raise ValueError(f"{self.prefix}.{name}: checkpoint part {part!r} is not one of {parts}")
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"{self.prefix}: checkpoint expert {expert} is outside [0, {self.num_experts})")
        if expert is None and loaded.shape[0] != self.num_experts:
            raise ValueError(f"{self.prefix}.{name}: checkpoint tensor for all experts, part {part}, has shape "
                             f"{tuple(loaded.shape)}: {loaded.shape[0]} experts, the model has {self.num_experts}")
        if self.parallel_mode == "expert":
            if expert is None:  # a fused 3-D tensor: this rank's block of experts
                loaded = loaded.narrow(0, self.expert_start, self.num_local_experts)
            elif not self.expert_start <= expert < self.expert_start + self.num_local_experts:
                return  # another rank's expert
            else:
                expert -= self.expert_start
        elif self.parallel_mode == "tensor":
            loaded = self._width_slice(param, loaded, which, expert is None)
        target = param.data[:, rows] if expert is None else param.data[expert, rows]
        if tuple(loaded.shape) != tuple(target.shape):
            where = "all experts" if expert is None else f"expert {expert}"
            raise ValueError(f"{self.prefix}.{name}: checkpoint tensor for {where}, part {part}, has shape "
                             f"{tuple(loaded.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded)
        experts = range(self.num_local_experts) if expert is None else [expert]
        self._filled[name].update((e, w) for e in experts for w in which)

    def _width_slice(self, param: nn.Parameter, loaded: torch.Tensor, parts: list[str],
                     all_experts: bool) -> torch.Tensor:
        """Tensor parallel: this rank's slice of a checkpoint tensor of `parts` (one part, or
        all of them in order), along the dim `param` declares (`output_dim`: rows of each
        part; `input_dim`: columns); `added_once`: kept on rank 0, zeros elsewhere."""
        from atom.model_ops.linear import _narrow
        r = self.tp.rank
        skip = 0 if all_experts else 1  # a per-expert tensor lacks the expert dim
        out_dim, in_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
        if out_dim is not None:
            dim, per = out_dim - skip, getattr(param, "rows_per_entry", 1)
            local = param.shape[out_dim] // len(self.expert_parts[param.expert_param])
            full = loaded.shape[dim] // len(parts)
            pieces = [_narrow(self, param.expert_param, loaded.narrow(dim, i * full, full), dim, r * local * per,
                              local * per, per) for i in range(len(parts))]
            loaded = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
        if in_dim is not None:
            per = getattr(param, "input_pack", 1)
            local = param.shape[in_dim] * per
            loaded = _narrow(self, param.expert_param, loaded, in_dim - skip, r * local, local, per)
        if getattr(param, "added_once", False) and r != 0:
            loaded = torch.zeros_like(loaded)
        return loaded

    def missing_shards(self) -> list[str]:
        """'param[expert].part' (global expert ids) for every part of this rank's experts
        that the checkpoint has not written."""
        out = []
        for name, parts in self.expert_parts.items():
            got = self._filled[name]
            out += [f"{self.prefix}.{name}[{e + self.expert_start}].{w}" for e in range(self.num_local_experts)
                    for w in parts if (e, w) not in got]
        return out

    #: per-expert tensor suffixes the loader maps (values and biases; quantized methods' scales)
    CHECKPOINT_SUFFIXES = ("weight", "bias", "weight_scale", "weight_scale_inv", "input_scale")

    @staticmethod
    def checkpoint_mapping(gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
                           experts: str = "experts") -> list[tuple[re.Pattern, str, str]]:
        """(regex, target suffix, part) for the loader: per-expert tensors
        `{experts}.{e}.{gate|up|down}.{suffix}` for each of `CHECKPOINT_SUFFIXES` (`.weight` ->
        `w13_weight` / `w2_weight`, `.weight_scale` -> `w13_weight_scale` / `w2_weight_scale`, ...;
        a suffix the layer's method did not create has no place and fails loading, naming the
        tensor), and the fused 3-D `{experts}.gate_up_proj` [E, 2I, H] / `{experts}.down_proj`
        [E, H, I] that transformers >= 5 writes (with or without `.weight`)."""
        x = re.escape(experts)
        out = [(re.compile(rf"\.{x}\.(?P<expert>\d+)\.{re.escape(src)}\.{suffix}$"), f".{experts}.{dst}_{suffix}", part)
               for suffix in FusedMoE.CHECKPOINT_SUFFIXES
               for src, dst, part in ((gate, "w13", "w1"), (up, "w13", "w3"), (down, "w2", "w2"))]
        out += [(re.compile(rf"\.{x}\.gate_up_proj(\.weight)?$"), f".{experts}.w13_weight", "w13"),
                (re.compile(rf"\.{x}\.down_proj(\.weight)?$"), f".{experts}.w2_weight", "w2")]
        return out

    def plan_installed(self, plan):
        """Read this layer's tile table from the plan once (outside any compiled region)."""
        device = next(self.parameters()).device
        self.tiles = plan.moe_tiles(self.num_local_experts, self.intermediate_size, self.hidden_size, self.act_dtype,
                                    device)
        self.tiles_json = self.tiles.to_json()
        return self.tiles

    def tile_table(self):
        """This layer's tile table (read from its plan the first time)."""
        return self.tiles if self.tiles is not None else self.plan_installed(self.plan)

    def op_activation(self) -> str:
        """The activation's name, as the experts ops (`experts_op`, what torch.compile traces)
        take it; registers the ops. A callable activation has no name to pass: refused."""
        if not self.activation_has_name:
            raise NotImplementedError(f"{self.prefix}: activation {self.activation_name!r} is a callable; "
                                      "under torch.compile the experts op needs one of ACTIVATIONS by name")
        from atom.model_ops.moe import experts_op  # noqa: F401  (registers the ops)
        return self.activation_name

    # --- forward ---------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.gather_tokens:
            return self._forward_across_replicas(hidden, router_logits, correction_bias)
        out = self.rank_output(hidden, router_logits, correction_bias)
        if self.tp.world_size > 1:
            out = self.tp.all_reduce(out)
            if self.shared_experts is not None and not self.shared_partial:
                out = out + self.shared_experts(hidden)
        return out

    def _forward_across_replicas(self, hidden, router_logits, correction_bias):
        """DP attention: every replica's tokens gathered (hidden states and router logits),
        this rank's experts run on all of them, the partial sums added across the replicas and
        each replica's rows handed back; the shared experts (replicated) on its own tokens. A
        replica without tokens takes part with none (its dummy step)."""
        if self.recorder is not None:  # this replica's own tokens
            self.recorder.record(self, self.route(router_logits, correction_bias)[1])
        h_all, counts = self.tp.gather_rows(hidden)
        logits_all, _ = self.tp.gather_rows(router_logits)
        if sum(counts) == 0:
            return torch.zeros_like(hidden)
        out = self.tp.sum_rows(self.rank_output(h_all, logits_all, correction_bias, record=False), counts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out

    def route(self, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) of the layer's `topk` rule: in one Triton kernel where the plan runs
        kernels for these logits outside torch.compile and the kernel computes the rule
        (`route_triton`), else the torch rule."""
        if self.routes_in_kernel(router_logits):
            return fused_topk(router_logits, self.topk, correction_bias)  # (it checks the shape)
        return self.topk(router_logits, correction_bias)

    def routes_in_kernel(self, router_logits: torch.Tensor) -> bool:
        """Whether `route` runs the routing kernel for these logits (see `route`)."""
        return (self.plan is not None and self.plan.kernels_for(router_logits) is not None
                and fused_topk_fits(self.topk) and router_logits.dim() == 2 and router_logits.stride(-1) == 1)

    def route_kernel(self) -> str:
        """What `route` runs outside torch.compile, for the MoE table's `route_kernel` column."""
        p = next(self.parameters(), None)
        if self.plan is not None and p is not None and self.plan.runs_kernels(p) and fused_topk_fits(self.topk):
            return "triton (route_triton.fused_topk)"
        return "torch (router.topk_select)" if self.topk.select_fn is None else "torch (select_fn)"

    def rank_output(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                    correction_bias: torch.Tensor | None = None, record: bool = True) -> torch.Tensor:
        """This rank's part of the output before the all-reduce: its experts (or its slice of
        every expert) on every token, plus the shared experts' partial sum where they leave
        it to this layer (at one rank: the whole output; under DP attention: none)."""
        if self.runs_stacked(hidden, router_logits):
            return self.stacked_output(hidden, router_logits, correction_bias, record)
        topk_weights, topk_ids = self.route(router_logits, correction_bias)
        if self.recorder is not None and record:
            self.recorder.record(self, topk_ids)  # global ids: every expert counted, on every rank
        if self.parallel_mode == "expert":
            topk_weights, topk_ids = self.local_routing(topk_weights, topk_ids)
        if self.shared_experts is None or self.gather_tokens or not (self.shared_partial or self.tp.world_size == 1):
            return self.method.apply(self, hidden, topk_weights, topk_ids)
        if self.overlaps_shared(hidden):
            return self.routed_beside_shared(hidden, topk_weights, topk_ids)
        return self.method.apply(self, hidden, topk_weights, topk_ids) + self.shared_experts(hidden)

    def overlaps_shared(self, hidden: torch.Tensor) -> bool:
        """Whether the shared experts run on the plan's second CUDA stream, beside the routed
        experts (`KernelPlan.overlaps_shared`)."""
        return self.plan is not None and self.plan.overlaps_shared(hidden)

    def routed_beside_shared(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                             topk_ids: torch.Tensor) -> torch.Tensor:
        """routed + shared, the shared experts' small products on a second stream while the
        routed experts' grouped GEMMs stream their weights (a decode step's shared products
        are too small to fill the GPU alone). The fork and join are stream waits, which a
        CUDA graph captures as its own edges."""
        main = torch.cuda.current_stream(hidden.device)
        side = self.plan.side_stream(hidden.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared = self.shared_experts(hidden)
        routed = self.method.apply(self, hidden, topk_weights, topk_ids)
        main.wait_stream(side)
        shared.record_stream(main)  # freed on the main stream's order, not the side stream's
        return routed + shared

    def runs_stacked(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> bool:
        """Whether the shared experts run inside the routed kernel (`shared_stack`): stacked
        (only where `shared_stack.why_not_stacked` found no reason against: one rank, a rule the
        routing kernel computes), the plan has "moe+shared" and runs the Triton experts and
        routing kernels here (`routes_in_kernel`: never under torch.compile)."""
        return (self.shared_stack is not None and self.routes_in_kernel(router_logits)
                and self.plan.has("moe+shared") and self.plan.experts_kernel(hidden) == "triton")

    def stacked_output(self, hidden, router_logits, correction_bias=None, record: bool = True) -> torch.Tensor:
        """Routed and shared experts in one grouped GEMM: each token's k choices plus the S
        stacked shared experts (ids E.., weight 1), summed in fp32 and rounded once."""
        from atom.model_ops.moe.experts_triton import fused_experts
        w13, w2, S = self.shared_stack
        topk_weights, topk_ids = fused_topk(router_logits, self.topk, correction_bias, fixed=S)
        if self.recorder is not None and record:
            self.recorder.record(self, topk_ids[:, :self.topk.top_k])  # the routed choice only
        return fused_experts(hidden, w13, w2, topk_weights, topk_ids, self.activation, tiles=self.tile_table())

    def local_routing(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallel: (weights, local ids) of the pairs, those of other ranks' experts
        with weight 0 and local id 0 (computed and dropped; an expert map the kernels skip
        would save that work on a GPU)."""
        local = topk_ids - self.expert_start
        mine = (local >= 0) & (local < self.num_local_experts)
        return (torch.where(mine, topk_weights, torch.zeros_like(topk_weights)),
                torch.where(mine, local, torch.zeros_like(local)))

    def extra_repr(self) -> str:
        stacked = f", shared stacked as {self.shared_stack[2]} experts" if self.shared_stack is not None else ""
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, width={self.intermediate_size}, "
                f"activation={self.activation_name}, bias={'w13_bias' in self.expert_parts}, "
                f"method={self.method.name}{self.parallel_repr()}{stacked}")

    def parallel_repr(self) -> str:
        if self.parallel_mode == "expert":
            return (f", ep={self.tp.rank}/{self.tp.world_size}: experts [{self.expert_start}, "
                    f"{self.expert_start + self.num_local_experts})")
        if self.parallel_mode == "tensor":
            return f", tp={self.tp.rank}/{self.tp.world_size}: width {self.intermediate_size}/{self.full_intermediate_size}"
        return ""
