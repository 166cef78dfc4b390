"""Fusions the runner installs on decoder layers from the engine's kernel plan.

A model's decoder layer reads like the architecture (norm -> attention -> norm -> MLP;
attention = project, rotate, attend, project). On the Triton backend, outside
torch.compile, the runner replaces that forward, layer by layer, with `fused_forward`,
which computes the same thing with fewer kernels where the plan says so:
- "norm+gemv" / "norm+gemv+silu": at batch 1, where the plan chose a Triton GEMV for the
  shape, the RMSNorm before the q/k/v and gate-up projections (and the SiLU-and-mul after
  gate-up) run inside the GEMV (`kernels.gemv_fused`);
- "w4_norm_gemv": at batch 1, the norm before the q/k/v product of 4-bit layers (W4A16,
  MXFP4 weight-only) on NVIDIA GPUs inside their one-row GEMV
  (`kernels.w4_gemv1.w4_gemv1_fused`): Llama-3.1-8B's batch-1 decode 1-1.4% faster (docs/perf).
  Gate-up keeps the norm kernel, its GEMV and SiLU-and-mul (`w4_one_row` says why);
- "norm+gemv+rope": at batch 1 without q/k norms (Llama), the q/k/v GEMV also rotates q and
  k and writes k, v into the paged cache (`kernels.gemv_rope`);
- "rope_in_attention": decode steps hand q, k unrotated to the attention kernel, which
  rotates them (after the q/k norms) and writes k, v itself; NVIDIA only (the kernel reads
  what it wrote after a block barrier, not checked on AMD GPUs);
- "rope+kv_write": otherwise the rotary kernel (with the q/k norms) also writes k, v into
  the cache, and the attention op only reads;
- "norm+quant" / "silu+quant": 8-bit projections whose method takes its input quantized
  (`method.input_quant`: dynamic per-token fp8 / int8 W8A8, dynamic per-tensor fp8 for one
  row) get it from the kernel in front (fp8 at every row count; int8 up to
  `FUSED_QUANT_MAX_ROWS` rows; the fused kernels give the separate kernels' bits): add +
  RMSNorm + quantize before the q/k/v and gate-up products,
  SiLU-and-mul + quantize before down (`kernels.act_quant_fused`), the product then reading q
  (`Linear.forward_quantized`, the method's usual routes);
- "sum+norm+quant": under "norm+quant", an 8-bit o_proj whose swap-AB product splits K
  (decode batches) leaves its partials unsummed (`kernels.split_k.PendingSum`): the
  norm-quantizer in front of gate-up adds them (`act_quant_fused.norm_quant`); so does down's
  product for the next decoder layer's norm-quantizer (`install` marks each layer followed by
  another in its list, `defer_output`; the last one's output is summed for the model's final
  norm): two launches fewer a layer, the same bits. Opt-in, not in `default_fusions`, until
  its decode timing is in docs/perf (its GPU tests are marked `gpu`);
- "quant_on_load": at one row (`QUANT_ON_LOAD_MAX_ROWS`: batch-1 decode), 8-bit products
  that take a per-token quantized input on the swap-AB route (ptpc fp8 at one row: on
  `fp8_gemv1`) quantize it as they load it,
  from rows stored unquantized beside partial amaxes (`kernels.pending_quant.PendingQuant`),
  instead of a quantizer launch in front: down, where SiLU-and-mul's quantizer splits rows
  over programs (`act_quant_fused.splits_rows`: Llama's 14,336-wide MLP; its first launch,
  `silu_amax`, stays), and o_proj, whose attention (the one-pass kernel or the split merge)
  stores each head's amax beside its output (under "norm+quant"). Two launches fewer a
  layer, the same bits; other routes quantize first. Opt-in: with `fp8_gemv1` quantizing on
  load, batch-1 ptpc FP8 decode measured slower than with the two quantizer launches
  (docs/perf: every program of the product quantizes the whole row again);
- "qkv_sum_in_attention": under "norm+quant" and "rope_in_attention", in decode steps, an
  8-bit q/k/v product without a bias whose K splits leaves its partials unsummed
  (`split_k.PendingSum`) and the attention kernel sums q, k and v as it loads them (the
  reduction's order and rounding: the same bits): one launch fewer a layer. Opt-in until its
  decode timing is in docs/perf;
- one row of ptpc fp8 runs its products on `kernels.fp8_gemv1` (CUDA cores, no split K;
  `quant.common.ONE_ROW_FP8`), not the swap-AB kernel: "sum+norm+quant", "split_k_fold" and
  "qkv_sum_in_attention" act on that kernel's split K, so the products they take at one row
  go back to the swap-AB kernel (docs/perf has their decode timings); "quant_on_load" stays
  on `fp8_gemv1`, which quantizes the pending row as it loads it
  (`fp8_gemv1.fp8_gemv1_pending_launch`);
- "moe+shared": MoE layers whose shared experts are an unquantized SiLU-gated MLP (DeepSeek)
  run them as extra experts of the grouped GEMM (`moe.shared_stack`). Opt-in only, not in
  `default_fusions`: the DeepSeek-V2-Lite workload ran slower with it than without (docs/perf),
  not yet timed layer by layer;
- "shared_overlap": MoE layers with shared experts (DeepSeek) run them on a second CUDA
  stream while the routed experts' grouped GEMMs run (`FusedMoE.routed_beside_shared`): a
  decode step's shared products are a few small GEMMs that alone leave most SMs idle;
- "split_k_fold": those 8-bit products (o_proj too, after its own quantizer) sum a split K
  inside the swap-AB kernel, with a counter buffer `install` gives each layer
  (`quant_gemv_dot.split_k_lock`), instead of a second reduction launch. Opt-in only, not in
  `default_fusions`: its GPU test differs from the separate reduction at 28672 x 4096
  (docs/perf has the layer timings);
- "fp4_pair_words": MXFP4 layers store their weight as pair words (`kernels.fp4_pairs`: the
  same codes, bits placed so that the one-row GEMV's fp16 pair decode takes 11 instructions a
  word instead of 15, and its scale multiply folded: `w4_gemv1.FOLD_PAIR_SCALES`; only layers
  whose E8M0 bytes lie in `fp4_pairs.FOLD_SCALES`; the other 4-bit kernels read them too),
  converted in place once (`Mxfp4LinearMethod.use_pair_words`; the layout stays when the plan
  is replaced, and the runner refuses the fusion after its graphs and torch.compile captured
  the model where it would still repack a layer: `pending_pair_words`). A default on the Triton backend (where
  the 4-bit kernels run: NVIDIA): batch-1 MXFP4 decode measured 4% faster with it, and the
  workload the same with and without it, since products of 65 rows or more run on the weight
  written out (`w4_gemm.W4_DEQUANT_MIN_M`; before, the batched kernels' slower decode of pair
  words cost the workload 4%: docs/perf);
- "merge_in_attention": split-KV decode steps (few sequences) merge the segments' partials in
  the attention kernel, in the program of each token and kv head that finishes last
  (`attention.split_merge`: an arrival counter a program group), instead of `_merge_kernel`'s
  launch after it. The attention op reads it from the plan (`meta.plan`); nothing is installed
  on the layers. A default on NVIDIA GPUs (Triton backend): batch-1 decode measured faster
  with it in every format (docs/perf);
- "w4_prepared_x": at batch 1, a dense MLP of 4-bit layers (W4A16, MXFP4 weight-only) on
  NVIDIA GPUs gets gate-up's input row from the add + RMSNorm kernel and down's from the
  SiLU-and-mul kernel already in the form the one-row GEMV's fp16 pair products use
  (`kernels.h2_xpack`: scaled, packed into fp16 pairs, summed), instead of every GEMV program
  preparing it again (its loop's instruction counts: docs/perf); the same launches, the same products.
  Opt-in, not in `default_fusions`: batch-1 decode measured slower with it (docs/perf);
- "w4_o_proj_norm" (with "w4_prepared_x"): there, when o_proj is 4-bit too, o_proj's one-row
  GEMV adds the residual in its epilogue and writes gate-up's input prepared from it (h w and
  the sums of h^2; `h2_xpack.store_added_prepared`), and gate-up applies 1 / rms at its end, so
  that the add + RMSNorm kernel between them does not run: one launch fewer a layer. Opt-in:
  prepared rows made batch-1 decode slower (docs/perf; likely because a prepared row is twice a
  16-bit row's bytes and every program of a product reads all of it);
- "w4_o_proj_add_norm": the same split of the add + RMSNorm without prepared rows: 4-bit
  o_proj's epilogue adds the residual and writes h w (w the norm's weight) as a plain 16-bit
  row with each program's sum of h^2 (`rmsnorm.store_added_row`), and gate-up's one-row GEMV
  scales its products by 1 / rms (`w4_gemv1_rsq`); SiLU-and-mul and down as before. A
  default on the Triton backend (where the 4-bit kernels run: NVIDIA): one launch fewer a
  layer, batch-1 decode measured faster in both 4-bit formats (docs/perf);
- "w4_gate_up_silu" (with "w4_o_proj_add_norm"): there, gate-up's one-row GEMV also applies
  SiLU-and-mul (`w4_gemv1_rsq(gated=True)`: a program's gate rows and the matching up rows,
  `w4_gemv1.gated_tiles`), so that the SiLU-and-mul kernel between gate-up and down does not
  run: one launch fewer a layer, the same bits. A default on the Triton backend (where the
  4-bit kernels run: NVIDIA) since the gated loop carries its up rows' pointers (int4's sm90
  loop 350 instructions a step against 381 before, the plain tile's 343): batch-1 decode
  measured faster with it in both 4-bit formats (docs/perf; with the norm inside too, a gated
  gate-up measured slower: `w4_one_row`);
- "w4_down_add_norm" (with "w4_o_proj_add_norm"): there, when the next decoder layer's q/k/v
  is 4-bit too, down's one-row GEMV adds the residual in its epilogue and writes the next
  layer's normed input as o_proj's does for gate-up (`normed_row.NormedRow`: h w with the sums
  of h^2), and that q/k/v is the plain one-row GEMV scaled by 1 / rms (`w4_normed_qkv`)
  instead of the GEMV with the norm inside ("w4_norm_gemv", whose loop adds, squares and weights
  x column by column: more instructions a weight, docs/perf). The same launches; `install` links
  each layer to the next (`next_layer`). Opt-in: batch-1 decode with it level on this
  q/k/v tile and slower on the norm GEMV's (docs/perf);
- "w4_l2_next" (with "w4_norm_gemv" and "w4_o_proj_add_norm"): there, the q/k/v GEMV's warps
  ask L2 after their loop for o_proj's words and gate-up's first bytes (`w4_gemv1`'s L2N: one
  bulk prefetch a warp), so that these stream from memory while the attention runs, whose
  batch-1 launch reads little, and the two products find them in L2; `L2_NEXT_BYTES` sets those
  bytes and those of the later products, each asking for the next one's weights (o_proj for
  gate-up's next bytes, gate-up for down's, down for the next layer's q/k/v). The same bits.
  Opt-in: batch-1 decode with it no faster in any of those forms, slower for MXFP4 wherever
  gate-up's bytes are asked for; with o_proj's words in L2 o_proj is barely faster, its time
  mostly the launch's fixed cost, and the prefetch slows the q/k/v GEMV it rides on (docs/perf);
Under torch.compile (level 3's prefill and mixed steps) the same forward runs its compiled
branch, `compiled_forward`, for inputs the plan's kernels take: the norms and SiLU-and-mul as
registered ops (`kernels.graph_ops`), and the rotary with the q/k norms and the cache write
inside the attention op (`Attention.forward_rope`: "rope+kv_write"), so that the compiled
graph runs the kernels level 0 runs instead of Inductor's code for them (docs/perf has the
prefill profiles of both).
A layer matches when it has the Llama-shaped parts (`matches`: a gated MLP or a MoE block,
which runs as it is after the norm; the compiled branch is for the gated MLP only); others
keep their forward.
`uninstall` restores the architecture's forward.
"""
from __future__ import annotations

import logging
import operator
import types

import torch
from torch import nn

from atom.model_ops.activation import silu_and_mul
from atom.model_ops.attention import get_forward_context
from atom.model_ops.kernels.split_k import PendingSum, settle
from atom.model_ops.quant import common, is_unquantized
from atom.model_ops.quant.common import InputQuant
from atom.tuning.normed_row import NormedRow

logger = logging.getLogger(__name__)


# the quantizing fusions' rows at most, by kind (a kind not named: every row count, prefills
# included): int8 where its GPU test found the separate kernels' bits (it differed by a step at
# 128 rows, before the quantizer's stores took the norm's layout); fp8 at every size, where
# the Llama-3.1-8B workload ran faster than with the separate quantizer above 128 rows
FUSED_QUANT_MAX_ROWS = {"int8": 64}
# "quant_on_load" rows at most: one row is quantized alone on load (quant_gemv_dot's X1); more
# rows quantize the product's whole padded operand every K step, the cost that kept the fused
# quantizer out of the table (quant_gemv_dot.FUSE_MAX_M)
QUANT_ON_LOAD_MAX_ROWS = 1
# "w4_l2_next": the weight bytes each 4-bit one-row GEMV of a layer asks L2 for after its loop,
# one product ahead (0: none). The q/k/v GEMV takes o_proj's words and gate-up's first bytes:
# about what memory moves while the batch-1 attention runs (~8 us at 3-4 TB/s), well under the
# 50 MB L2 of the H100 / H200 beside o_proj's and q/k/v's own weights. The later stages (o_proj:
# gate-up's next bytes; gate-up: down's first; down: the next layer's q/k/v) are off: with every
# stage at 16 MiB batch-1 decode was 9-11% slower (docs/perf)
L2_NEXT_BYTES = {
    "gate_up_from_qkv": 16 << 20,
    "gate_up_from_o_proj": 0,
    "down_from_gate_up": 0,
    "qkv_from_down": 0,
}


def default_fusions(backend: str) -> tuple[str, ...]:
    """The fusions a backend runs at level 0 (the Triton kernels; AITER shares them)."""
    if backend == "torch":
        return ()
    out = ("norm+gemv", "norm+gemv+silu", "norm+gemv+rope", "rope+kv_write")
    if torch.version.hip is None:
        out += ("rope_in_attention",)
        if backend == "triton":  # the in-kernel merge's GPU-scope counter is timed on NVIDIA only
            out += ("merge_in_attention",)
    if backend == "triton":  # the 8-bit and 4-bit products' kernels (NVIDIA; ROCm's run the reference)
        out += ("norm+quant", "silu+quant", "w4_norm_gemv", "fp4_pair_words")
        out += ("w4_o_proj_add_norm",)
        out += ("w4_gate_up_silu",)
    return out + ("shared_overlap",)


def dense_mlp(layer: nn.Module) -> bool:
    """Whether the layer's MLP is the gated one (gate_up_proj, down_proj), not a MoE block."""
    return all(hasattr(layer.mlp, n) for n in ("gate_up_proj", "down_proj"))


def matches(layer: nn.Module) -> bool:
    """Whether a decoder layer has the parts `fused_forward` uses: the Llama-shaped attention
    (without sinks) and either the gated MLP or a MoE block (`experts`, run as it is, after the
    norm)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm"))
            and attn is not None and all(hasattr(attn, n) for n in ("qkv_proj", "o_proj", "rotary_emb", "attn"))
            and getattr(attn, "sinks", None) is None
            and mlp is not None and (dense_mlp(layer) or hasattr(mlp, "experts")))


def _count_layers(model: nn.Module, method_call: str) -> int:
    """How many layers' `method.<method_call>(layer)` answer true (layers whose method has it)."""
    return sum(bool(getattr(m.method, method_call)(m)) for m in model.modules()
               if callable(getattr(getattr(m, "method", None), method_call, None)))


def pending_pair_words(model: nn.Module) -> int:
    """How many MXFP4 layers "fp4_pair_words" would repack now (`Mxfp4LinearMethod.pair_words_pending`)."""
    return _count_layers(model, "pair_words_pending")


def install(model: nn.Module, plan) -> int:
    """Install `fused_forward` on every matching decoder layer and declare the one-row
    variants each projection is called with (for the start-up GEMV choice); returns how
    many layers took it. Without fusions in the plan, nothing changes."""
    n = 0
    if not plan.fusions:
        return 0
    if plan.has("fp4_pair_words"):
        paired = _count_layers(model, "use_pair_words")  # repacks where pending
        if paired:  # a default fusion: silent for models without MXFP4 layers
            logger.info("MXFP4 pair words on %d layers", paired)
    if plan.has("moe+shared"):
        from atom.model_ops.moe import FusedMoE
        from atom.model_ops.moe.shared_stack import stack_shared_experts
        stacked = [m for m in model.modules() if isinstance(m, FusedMoE) and stack_shared_experts(m)]
        if stacked:
            logger.info("shared experts stacked into the routed experts of %d MoE layers", len(stacked))
    for m in model.modules():
        if matches(m):
            attn = m.self_attn
            qk_norm = getattr(attn, "qk_norm", False)
            attn.qkv_proj.one_row = (("norm",) if plan.has("norm+gemv") else ()) + \
                (("norm+rope",) if plan.has("norm+gemv+rope") and not qk_norm else ())
            if dense_mlp(m):
                m.mlp.gate_up_proj.one_row = "norm+silu" if plan.has("norm+gemv+silu") else ()
            if plan.has("split_k_fold"):
                _give_locks(m)
            m.forward = types.MethodType(fused_forward, m)
            n += 1
    for layers in (m for m in model.modules() if isinstance(m, nn.ModuleList)):
        items = list(layers)
        for layer, after in zip(items, items[1:]):  # the next layer reads this one's output directly
            if matches(layer) and matches(after):
                if plan.has("sum+norm+quant"):
                    layer.defer_output = True
                if (plan.has("w4_down_add_norm") or plan.has("w4_l2_next")) and dense_mlp(layer):
                    layer.__dict__["next_layer"] = after  # a plain reference, not a submodule
    logger.info("fusions %s installed on %d decoder layers", list(plan.fusions), n)
    return n


def _give_locks(layer: nn.Module) -> None:
    """Each 8-bit projection of the decoder layer that takes a quantized input gets its split-K
    counters, once: kept after `uninstall` too, since a CUDA graph captured with them keeps
    their address."""
    from atom.model_ops.kernels.quant_gemv_dot import split_k_lock
    attn, mlp = layer.self_attn, layer.mlp
    mlps = (mlp.gate_up_proj, mlp.down_proj) if dense_mlp(layer) else ()
    for linear in (attn.qkv_proj, attn.o_proj, *mlps):
        if linear.method.input_quant(linear) is not None and "split_k_lock" not in linear.__dict__:
            linear.split_k_lock = split_k_lock(linear.weight.shape[0], linear.weight.device)


def quant_input(plan, fusion: str, linear: nn.Module, x: torch.Tensor) -> InputQuant | None:
    """How `fusion`'s kernel quantizes x, the input of `linear`, for it to read (None: the
    layer takes x): the plan has the fusion, the method takes a quantized input for x's rows
    (per-tensor scales: one row only), and its kernels run for x (an NVIDIA GPU, or the
    interpreter when the plan forces the kernels, the product then on its torch reference)."""
    if plan is None or not plan.has(fusion) or x.dim() != 2:
        return None
    iq = linear.method.input_quant(linear)
    rows = x.shape[0]
    if iq is None or (not iq.per_token and rows != 1) or rows > FUSED_QUANT_MAX_ROWS.get(iq.kind, rows):
        return None
    return iq if common.use_kernels(x) or plan.force_kernels else None


def _lock(plan, linear: nn.Module) -> torch.Tensor | None:
    return linear.__dict__.get("split_k_lock") if plan is not None and plan.has("split_k_fold") else None


def project(plan, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)`; with "split_k_fold" on an 8-bit layer that takes a quantized input, its
    quantizer (`act_quant`) and then the product with the split K folded in."""
    iq = quant_input(plan, "split_k_fold", linear, x)
    lock = _lock(plan, linear)
    if iq is None or lock is None:
        return linear(x)
    from atom.model_ops.kernels.act_quant import act_quant
    q, s = act_quant(x, iq.kind, x.shape[-1], iq.qmax)
    return linear.forward_quantized(q, s, x.dtype, lock)


def _rows(x) -> torch.Tensor:
    """A tensor with x's rows, device and rank for the fusions' checks: x, a `PendingSum`'s
    first partial, or a `NormedRow`'s row."""
    if isinstance(x, NormedRow):
        return x.hw
    return x.part[0] if isinstance(x, PendingSum) else x


def project_pending(plan, linear: nn.Module, x: torch.Tensor):
    """`project`, except that with "sum+norm+quant" an 8-bit layer that takes a quantized
    input runs its quantizer, then its product with a split K left unsummed: a
    `split_k.PendingSum` where the product splits K, else the product."""
    iq = quant_input(plan, "sum+norm+quant", linear, x)
    if iq is None or not plan.has("norm+quant") or _lock(plan, linear) is not None:
        return project(plan, linear, x)
    from atom.model_ops.kernels.act_quant import act_quant
    q, s = act_quant(x, iq.kind, x.shape[-1], iq.qmax)
    return linear.forward_quantized(q, s, x.dtype, defer_sum=True)


def uninstall(model: nn.Module) -> None:
    for m in model.modules():
        m.__dict__.pop("defer_output", None)
        m.__dict__.pop("next_layer", None)
        if "forward" in m.__dict__ and matches(m):
            del m.forward
            m.self_attn.qkv_proj.one_row = "plain"
            if dense_mlp(m):
                m.mlp.gate_up_proj.one_row = "plain"


def w4_one_row(plan, linear: nn.Module, x: torch.Tensor, gated: bool) -> tuple | None:
    """The operands of `w4_gemv1_fused` for one row x into a 4-bit layer (its method's
    `one_row_operands`) where the plan has "w4_norm_gemv", the product is not gated, the layer
    has no bias and the 4-bit kernels run for x (NVIDIA CUDA); else None. A gated (gate-up)
    product keeps the norm kernel, the GEMV and SiLU-and-mul: the norm and SiLU inside it, the
    norm alone, and SiLU-and-mul in down's prologue all measured slower
    (`scripts/w4_fused_sweep.py`; docs/perf has the figures)."""
    if plan is None or not plan.has("w4_norm_gemv") or gated:
        return None
    return _w4_row_operands(linear, x)


def _w4_row_operands(linear: nn.Module, x: torch.Tensor) -> tuple | None:
    """(packed, scales, zeros, fmt, group, K) of a 4-bit layer without a bias for one row x
    where the 4-bit kernels run for x (NVIDIA CUDA); else None. None too for a row-parallel
    layer whose partial products are summed over tensor-parallel ranks in its forward: the
    fused paths launch the product themselves, without that all-reduce."""
    if x.dim() != 2 or x.shape[0] != 1 or linear.bias is not None:
        return None
    if getattr(linear, "reduce_results", False) and linear.tp.world_size > 1:
        return None
    operands = getattr(linear.method, "one_row_operands", None)
    if operands is None:
        return None
    from atom.model_ops.kernels.w4_gemm import use_w4_kernel
    return operands(linear) if use_w4_kernel(x) else None


def w4_prepared_mlp(plan, mlp: nn.Module, norm, hidden: torch.Tensor, residual):
    """"w4_prepared_x": down(silu_and_mul(gate_up(norm(hidden + residual)))) of one row through
    the 4-bit one-row GEMV's prepared-row loop (`kernels.h2_xpack`: the norm kernel and the
    SiLU kernel write their rows prepared), or None where that does not apply (not both
    products 4-bit, a bias, not a 16-bit row where the 4-bit kernels run). Returns (y,
    hidden + residual)."""
    if plan is None or not plan.has("w4_prepared_x") or not isinstance(hidden, torch.Tensor) \
            or hidden.dtype not in (torch.bfloat16, torch.float16):
        return None
    gate_up, down = _w4_row_operands(mlp.gate_up_proj, hidden), _w4_row_operands(mlp.down_proj, hidden)
    if gate_up is None or down is None:
        return None
    from atom.model_ops.kernels.h2_xpack import norm_prepare, silu_prepare
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_prepared
    row, residual = norm_prepare(hidden, residual, norm.weight, norm.eps, gate_up[3] == "int4")
    y = w4_gemv1_prepared(row, *gate_up)
    return w4_gemv1_prepared(silu_prepare(y, down[3] == "int4"), *down), residual


def norm_linear(norm, linear, x: torch.Tensor, residual: torch.Tensor | None, gated: bool = False,
                defer_sum: bool = False, l2_next=()):
    """`linear(norm(x + residual))`, then SiLU-and-mul when `gated`; returns (y, x + residual)
    like the norm (no add when `residual` is None: the residual is then x). An 8-bit layer
    under "norm+quant" reads its input quantized by the norm's kernel (any batch), and with
    `defer_sum` (not gated) may return its split-K product unsummed (`split_k.PendingSum`);
    one row of an unquantized layer, where the plan chose a Triton GEMV for the shape, runs
    as one fused kernel. `l2_next`: weight regions a 4-bit one-row GEMV asks L2 for
    ("w4_l2_next", `w4_l2_next_regions`)."""
    plan = linear.plan
    if isinstance(x, PendingSum):  # a split-K product left unsummed ("sum+norm+quant")
        iq = quant_input(plan, "norm+quant", linear, _rows(x))
        if iq is None or residual is None:
            x, iq = x.result(), None
    else:
        iq = quant_input(plan, "norm+quant", linear, x)
    if iq is not None:  # the norm's kernel quantizes the row for the 8-bit product (and sums a pending product)
        from atom.model_ops.kernels.act_quant_fused import norm_quant
        q, s, residual = norm_quant(x, residual, norm.weight, norm.eps, iq.kind, iq.qmax)
        lock = _lock(plan, linear)
        y = linear.forward_quantized(q, s, x.dtype, lock, defer_sum=defer_sum and not gated and lock is None)
        return (silu_and_mul(y) if gated else y), residual
    ops = w4_one_row(plan, linear, x, gated)
    if ops is not None:  # a 4-bit layer's one-row GEMV with the norm (and SiLU-and-mul) inside
        from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_fused
        return w4_gemv1_fused(x, residual, norm.weight, norm.eps, *ops, gated=gated, l2_next=l2_next)
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
    y = project(plan, linear, h)
    return (silu_and_mul(y) if gated else y), residual


def _mlp(layer: nn.Module, plan, hidden: torch.Tensor, residual: torch.Tensor):
    """down(silu_and_mul(gate_up(norm(hidden + residual)))), hidden + residual; with "silu+quant"
    (an 8-bit down that takes a quantized input) the SiLU kernel quantizes for down."""
    mlp, norm = layer.mlp, layer.post_attention_layernorm
    if not dense_mlp(layer):  # a MoE block: its own router and experts after the norm
        hidden, residual = norm(settle(hidden), residual)
        return mlp(hidden), residual
    prepared = w4_prepared_mlp(plan, mlp, norm, hidden, residual)
    if prepared is not None:
        return prepared
    iq = quant_input(plan, "silu+quant", mlp.down_proj, _rows(hidden))
    if iq is None:
        act, residual = norm_linear(norm, mlp.gate_up_proj, hidden, residual, gated=True)
        return project(plan, mlp.down_proj, act), residual
    from atom.model_ops.kernels.act_quant_fused import silu_amax, silu_quant, splits_rows
    y, residual = norm_linear(norm, mlp.gate_up_proj, hidden, residual)
    if plan.has("quant_on_load") and iq.per_token and y.shape[0] <= QUANT_ON_LOAD_MAX_ROWS \
            and splits_rows(y.shape[0], y.shape[1] // 2):
        q, s = silu_amax(y, iq.kind, iq.qmax), None  # rows left for down's product to quantize on load
    else:
        q, s = silu_quant(y, iq.kind, iq.qmax)
    lock = _lock(plan, mlp.down_proj)
    defer = getattr(layer, "defer_output", False) and lock is None and plan.has("sum+norm+quant") \
        and plan.has("norm+quant")  # the next layer's norm-quantizer sums a split K
    return mlp.down_proj.forward_quantized(q, s, y.dtype, lock, defer_sum=defer), residual


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


def _attention(attn, plan, positions: torch.Tensor, qkv: torch.Tensor, project: bool = True) -> torch.Tensor:
    """Rotate, write the cache and attend with the fused kernels; o_proj of the result (the
    attention's output itself where not `project`)."""
    q_size, kv_size = attn.qkv_proj.q_size, attn.qkv_proj.kv_size
    meta = get_forward_context()
    rope_in = plan.has("rope_in_attention") and meta.max_query_len == 1
    qkv_sum = None
    if isinstance(qkv, PendingSum):  # a split-K product left to the attention kernel to sum
        if rope_in:
            qkv_sum, qkv = (qkv.part.shape[0], qkv.part.stride(0), qkv.dtype), qkv.part[0]
        else:
            qkv = qkv.result()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if rope_in:
        # decode: the attention kernel rotates q and k (after the q / k norms) and writes k, v
        norms = _qk_norms(attn)
        rotary = (attn.rotary_emb.cos_sin_cache,) + ((norms[0].weight, norms[1].weight, norms[0].eps)
                                                     if norms else ())
        return _attend_project(attn, plan, q, k, v, rotary, qkv_sum, project=project)
    target = attn.attn.backend.cache_target(attn.attn, meta) if plan.has("rope+kv_write") else None
    if target is not None:  # (None: the backend writes this cache itself, e.g. FP8)
        # one kernel: q/k norm, rotary, and this step's k and v into the paged cache
        attn.rotary_emb(positions, q, k, *_qk_norms(attn), kv_cache=(v, *target))
        return _attend_project(attn, plan, q, None, None, project=project)
    q, k = attn.rotary_emb(positions, q, k, *_qk_norms(attn))
    return _attend_project(attn, plan, q, k, v, project=project)


def _attend_project(attn, plan, q, k, v, rotary=None, qkv_sum=None, project: bool = True):
    """o_proj(attention(q, k, v)) (`qkv_sum`: q, k, v are split-K partials the attention
    sums, `Attention.forward`); with "quant_on_load", for an 8-bit o_proj that takes a
    per-token quantized input, at one row (the swap-AB product's route; another route
    quantizes first, `quant.common.prequantized_product`), the attention also stores each
    head's amax of its output and o_proj quantizes the output on load
    (`pending_quant.PendingQuant`) instead of a quantizer launch in between."""
    o_proj = attn.o_proj
    if not project:
        return attn.attn(q, k, v, rotary, qkv_sum=qkv_sum)
    dtype = qkv_sum[2] if qkv_sum is not None else q.dtype
    iq = quant_input(plan, "quant_on_load", o_proj, q)
    if iq is None or not iq.per_token or q.shape[0] > QUANT_ON_LOAD_MAX_ROWS or not plan.has("norm+quant"):
        return project_pending(plan, o_proj, attn.attn(q, k, v, rotary, qkv_sum=qkv_sum))
    from atom.model_ops.kernels.pending_quant import PendingQuant
    amax = torch.empty(q.shape[0], attn.attn.num_heads, dtype=torch.float32, device=q.device)
    pending = PendingQuant(attn.attn(q, k, v, rotary, amax=amax, qkv_sum=qkv_sum), amax, iq.kind, iq.qmax)
    lock = _lock(plan, o_proj)
    defer = plan.has("sum+norm+quant") and lock is None  # the next norm-quantizer sums a split K
    return o_proj.forward_quantized(pending, None, dtype, lock, defer_sum=defer)


def _qk_norms(attn) -> tuple:
    """(q_norm, k_norm) of an attention with per-head q/k RMSNorms (Qwen3), else ()."""
    return (attn.q_norm, attn.k_norm) if getattr(attn, "qk_norm", False) else ()


def compiled_forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
    """The decoder layer as a compiled graph traces it (see the module docstring)."""
    from atom.model_ops.kernels import graph_ops
    attn, mlp = self.self_attn, self.mlp
    h, residual = graph_ops.norm(self.input_layernorm, hidden, residual)
    out = attn.attn.forward_rope(attn.qkv_proj(h), attn.qkv_proj.q_size, positions, attn.rotary_emb.cos_sin_cache,
                                 *_qk_norms(attn))
    h, residual = graph_ops.norm(self.post_attention_layernorm, attn.o_proj(out), residual)
    return mlp.down_proj(torch.ops.atom.silu_and_mul(mlp.gate_up_proj(h))), residual


def fused_forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
    """The decoder layer's forward with the plan's fusions (see the module docstring); falls
    back to the architecture's forward on the torch backend."""
    attn = self.self_attn
    plan = attn.qkv_proj.plan
    if isinstance(hidden, PendingSum):  # the layer before left its down product unsummed
        if torch.compiler.is_compiling() or attn.attn.backend.name != "triton" \
                or quant_input(plan, "norm+quant", attn.qkv_proj, _rows(hidden)) is None:
            hidden = hidden.result()
    on_triton = plan is not None and plan.runs_kernels(_rows(hidden)) and attn.attn.backend.name == "triton"
    qkv = None
    if isinstance(hidden, NormedRow):  # the layer before wrote this one's normed input ("w4_down_add_norm")
        qkv = w4_normed_qkv(attn, hidden, w4_l2_next_regions(self, plan, hidden.hw)) \
            if on_triton and not torch.compiler.is_compiling() else None
        if qkv is None:
            hidden = hidden.as_input(residual)
    if torch.compiler.is_compiling():
        if on_triton and plan.has("rope+kv_write") and dense_mlp(self):
            return compiled_forward(self, positions, hidden, residual)
        return type(self).forward(self, positions, hidden, residual)
    if not on_triton:
        return type(self).forward(self, positions, hidden, residual)
    fused = None
    if qkv is None and plan.has("norm+gemv+rope") and not getattr(attn, "qk_norm", False) and hidden.shape[0] == 1:
        target = attn.attn.backend.cache_target(attn.attn, get_forward_context())
        if target is not None:
            fused = norm_linear_rope(self.input_layernorm, attn.qkv_proj, hidden, residual, positions,
                                     attn.rotary_emb.cos_sin_cache, *target)
    if fused is not None:  # q rotated, k and v in the cache
        qkv, residual = fused
        hidden = project_pending(plan, attn.o_proj, attn.attn(qkv[:, :attn.qkv_proj.q_size], None, None))
    else:
        if qkv is None:
            qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, hidden, residual,
                                        defer_sum=_qkv_sum_in_attention(attn, plan),
                                        l2_next=w4_l2_next_regions(self, plan, hidden))
        ops = w4_o_proj_norm_operands(self, plan, qkv)
        if ops is not None:  # o_proj's epilogue adds the residual and prepares gate-up's input
            return w4_o_proj_norm_mlp(self, ops, _attention(attn, plan, positions, qkv, project=False), residual)
        ops = w4_o_proj_add_norm_operands(self, plan, qkv)
        if ops is not None:  # o_proj's epilogue adds the residual and writes gate-up's input
            out = _attention(attn, plan, positions, qkv, project=False)
            return w4_o_proj_add_norm_mlp(self, plan, ops, out, residual)
        hidden = _attention(attn, plan, positions, qkv)
    return _mlp(self, plan, hidden, residual)


def w4_o_proj_norm_operands(layer: nn.Module, plan, qkv) -> tuple | None:
    """"w4_o_proj_norm" (with "w4_prepared_x"): the 4-bit operands of o_proj, gate-up and down
    (`_w4_row_operands`) for a one-row 16-bit step where the 4-bit kernels run, whose o_proj tile
    owns whole word columns of its output (`w4_gemv1.add_prepared_applies`), a dense MLP; else
    None."""
    ops = _w4_layer_rows(layer, plan, qkv, ("w4_o_proj_norm", "w4_prepared_x"),
                         ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
    if ops is None:
        return None
    from atom.model_ops.kernels.w4_gemv1 import add_prepared_applies, tiles
    o = ops[0]
    return ops if add_prepared_applies(o[0].shape[0], tiles(o[0].shape[0], o[3], o[5])) else None


def w4_o_proj_norm_mlp(layer: nn.Module, ops: tuple, out: torch.Tensor, residual: torch.Tensor):
    """o_proj(out) + residual, RMSNorm, gate-up, SiLU-and-mul, down for one row of 4-bit layers:
    o_proj's epilogue adds and prepares the norm's input (`w4_gemv1.w4_gemv1_add_prepared`),
    gate-up applies 1 / rms (`w4_gemv1_prepared`), the SiLU kernel prepares down's input.
    Returns (y, the new residual)."""
    from atom.model_ops.kernels.h2_xpack import silu_prepare
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_add_prepared, w4_gemv1_prepared
    norm = layer.post_attention_layernorm
    o, gate_up, down = ops
    row, residual = w4_gemv1_add_prepared(out, *o, residual, norm.weight, norm.eps, gate_up[3] == "int4")
    y = w4_gemv1_prepared(row, *gate_up)
    return w4_gemv1_prepared(silu_prepare(y, down[3] == "int4"), *down), residual


def w4_o_proj_add_norm_operands(layer: nn.Module, plan, qkv) -> tuple | None:
    """"w4_o_proj_add_norm": the 4-bit operands of o_proj and gate-up (`_w4_row_operands`) for a
    one-row 16-bit step where the 4-bit kernels run, a dense MLP; else None. A plan with the
    opt-in "w4_prepared_x" gets None: its MLP takes the prepared rows (`w4_prepared_mlp`)."""
    if plan is not None and plan.has("w4_prepared_x"):
        return None
    return _w4_layer_rows(layer, plan, qkv, ("w4_o_proj_add_norm",), ("self_attn.o_proj", "mlp.gate_up_proj"))


def _w4_layer_rows(layer: nn.Module, plan, qkv, fusions: tuple, linears: tuple) -> tuple | None:
    """The 4-bit one-row operands (`_w4_row_operands`) of the layer's linears named in `linears`
    (attribute paths, read once the layer is known to be a dense MLP) for a one-row 16-bit step
    of a layer whose plan has every one of `fusions`; else None."""
    if plan is None or not all(plan.has(f) for f in fusions) or not dense_mlp(layer) \
            or not isinstance(qkv, torch.Tensor) or qkv.dtype not in (torch.bfloat16, torch.float16):
        return None
    ops = tuple(_w4_row_operands(operator.attrgetter(name)(layer), qkv) for name in linears)
    return None if any(o is None for o in ops) else ops


def w4_o_proj_add_norm_mlp(layer: nn.Module, plan, ops: tuple, out: torch.Tensor, residual: torch.Tensor):
    """o_proj(out) + residual, RMSNorm, gate-up, SiLU-and-mul, down for one row: o_proj's
    epilogue adds and writes h w with its sums of h^2 (`w4_gemv1.w4_gemv1_add_row`), gate-up
    scales by 1 / rms (`w4_gemv1_rsq`), and with "w4_gate_up_silu" applies SiLU-and-mul too.
    Returns (y, the new residual); with "w4_down_add_norm" where it applies
    (`w4_down_add_norm_operands`), down's epilogue adds the residual too: (`NormedRow`, y + residual)."""
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_add_row, w4_gemv1_rsq
    norm = layer.post_attention_layernorm
    o, gate_up = ops
    l2 = w4_l2_next_mlp(layer, plan, gate_up[0], out)  # {} without "w4_l2_next"
    hw, sums, residual = w4_gemv1_add_row(out, *o, residual, norm.weight, l2_next=l2.get("o_proj", ()))
    if plan.has("w4_gate_up_silu"):
        act = w4_gemv1_rsq(hw, sums, norm.eps, *gate_up, gated=True, l2_next=l2.get("gate_up", ()))
    else:
        act = silu_and_mul(w4_gemv1_rsq(hw, sums, norm.eps, *gate_up, l2_next=l2.get("gate_up", ())))
    rows = w4_down_add_norm_operands(layer, plan, act)
    if rows is not None:  # down's epilogue adds the residual and writes the next layer's normed input
        down, norm_next = rows
        hw, sums, residual = w4_gemv1_add_row(act, *down, residual, norm_next.weight, l2_next=l2.get("down", ()))
        return NormedRow(hw, sums, norm_next.eps), residual
    if l2.get("down"):  # down's one-row GEMV asks L2 for the next layer's q/k/v words
        from atom.model_ops.kernels.w4_gemm import w4_linear_launch
        packed, scales, zeros, fmt, group, k = _w4_row_operands(layer.mlp.down_proj, act)
        return w4_linear_launch(act, packed, scales, zeros, None, fmt, group, k, l2_next=l2["down"]), residual
    return project(plan, layer.mlp.down_proj, act), residual


def w4_l2_next_regions(layer: nn.Module, plan, hidden) -> tuple:
    """"w4_l2_next": the weight regions the q/k/v GEMV asks L2 for, (o_proj's words, all of
    them) and gate-up's first `L2_NEXT_BYTES["gate_up_from_qkv"]` bytes, for a one-row 16-bit
    step (`hidden`: the row into q/k/v) of a layer whose o_proj and gate-up are 4-bit one-row
    products; else ()."""
    if plan is None or not plan.has("w4_l2_next"):
        return ()
    ops = _w4_layer_rows(layer, plan, hidden, ("w4_l2_next", "w4_o_proj_add_norm"),
                         ("self_attn.o_proj", "mlp.gate_up_proj"))
    if ops is None:
        return ()
    (o_words, *_), (gate_up_words, *_) = ops
    return _regions((o_words, 0, o_words.numel() * o_words.element_size()),
                    (gate_up_words, 0, L2_NEXT_BYTES["gate_up_from_qkv"]))


def _regions(*spans) -> tuple:
    """(tensor, bytes) regions for `w4_gemv1.l2_next_args` from (words, start byte, bytes) spans:
    the words' bytes from `start` (a multiple of 16) on, a view of them; spans of no bytes,
    starting past the words, or of strided words (no view: a copy would be prefetched) left
    out."""
    out = []
    for words, start, nbytes in spans:
        if start % 16:
            raise ValueError(f"a w4_l2_next span starts at byte {start}: a multiple of 16 is needed")
        size = words.element_size()
        if nbytes > 0 and start < words.numel() * size and words.is_contiguous():
            out.append((words.view(-1)[start // size:], nbytes))
    return tuple(out)


def w4_l2_next_mlp(layer: nn.Module, plan, gate_up_words: torch.Tensor, act: torch.Tensor) -> dict:
    """"w4_l2_next" in the MLP of a one-row 4-bit layer (`gate_up_words`: its 4-bit gate-up's
    words, as `w4_o_proj_add_norm_operands` gave them): the regions o_proj, gate-up and down ask
    L2 for (`L2_NEXT_BYTES`): gate-up's bytes after those the q/k/v stage asks for (whether or
    not q/k/v ran a 4-bit product that asked), down's first, and the next decoder layer's q/k/v
    words (`install`'s `next_layer` link). {} without the fusion or where down is not a 4-bit
    one-row product."""
    if plan is None or not plan.has("w4_l2_next"):
        return {}
    down = _w4_row_operands(layer.mlp.down_proj, act)
    if down is None:
        return {}
    after = layer.__dict__.get("next_layer")
    qkv = _w4_row_operands(after.self_attn.qkv_proj, act) if after is not None else None
    b = L2_NEXT_BYTES
    return {"o_proj": _regions((gate_up_words, b["gate_up_from_qkv"] // 16 * 16, b["gate_up_from_o_proj"])),
            "gate_up": _regions((down[0], 0, b["down_from_gate_up"])),
            "down": _regions((qkv[0], 0, b["qkv_from_down"])) if qkv is not None else ()}


def w4_down_add_norm_operands(layer: nn.Module, plan, act: torch.Tensor) -> tuple | None:
    """"w4_down_add_norm": (down's 4-bit one-row operands, the next layer's input norm) for the
    one row `act` into down, where `install` linked the layer to a next decoder layer
    (`next_layer`) whose q/k/v is a 4-bit layer without a bias the kernels run for it; else None."""
    after = layer.__dict__.get("next_layer")
    if plan is None or after is None or not plan.has("w4_down_add_norm"):
        return None
    down = _w4_row_operands(layer.mlp.down_proj, act)
    if down is None or _w4_row_operands(after.self_attn.qkv_proj, act) is None:
        return None
    return down, after.input_layernorm


def w4_normed_qkv(attn, row: NormedRow, l2_next=()) -> torch.Tensor | None:
    """q/k/v of the normed input the layer before wrote (`NormedRow`): the plain one-row 4-bit
    GEMV on h w on the table's tile (`w4_gemv1.tiles`), its products scaled by 1 / rms
    (`w4_gemv1_rsq`). On the norm GEMV's 4-warp tile (`fused_tiles`) batch-1 decode was slower,
    MXFP4 most (docs/perf); None where q/k/v is not a 4-bit layer without a bias that the
    kernels run for the row. `l2_next`: "w4_l2_next"'s regions (`w4_l2_next_regions`)."""
    ops = _w4_row_operands(attn.qkv_proj, row.hw)
    if ops is None:
        return None
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_rsq
    return w4_gemv1_rsq(row.hw, row.sums, row.eps, *ops, l2_next=l2_next)


def _qkv_sum_in_attention(attn, plan) -> bool:
    """Whether this step's q/k/v product may leave a split K to the attention kernel
    ("qkv_sum_in_attention": a decode step the kernel rotates, q/k/v without a bias)."""
    return plan.has("qkv_sum_in_attention") and plan.has("rope_in_attention") \
        and get_forward_context().max_query_len == 1 and attn.qkv_proj.bias is None
