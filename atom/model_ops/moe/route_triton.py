"""The routing rule of `router.topk_select` in one Triton kernel, for the layers whose rule it
computes: softmax or sigmoid scores, an optional correction bias for the choice, the k best,
optional renormalisation and `routed_scaling_factor` (no expert groups, no `select_fn`).

Why: in torch the rule is ~6 small kernels a MoE layer (the fp32 cast, softmax, top-k and its
sort, the gather, the scaling), ~20 us of a decode step's layer on an H200 against the
experts' ~150 us; here one program handles ROWS tokens: scores in fp32 over the whole row,
then k rounds of "take the best, mask it" (ties to the lower expert id), weights in the order
chosen (best first, as torch.topk), renormalised and scaled in fp32. The engine takes it where
the kernel plan runs kernels outside torch.compile (`FusedMoE.route`); compiled graphs keep
the torch rule for Inductor to fuse.

    weights, ids = fused_topk(logits, topk)       # topk: the layer's `router.TopK`
"""
from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

MAX_EXPERTS = 1024  # one row of scores per program in registers
# `route_config`: rows a program up to / past ROWS_SWITCH tokens (scripts/moe_route_sweep.py;
# the timings are in docs/perf)
ROWS_SMALL, ROWS_LARGE, ROWS_SWITCH = 1, 4, 2048

if HAS_TRITON:

    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, E, stride_t, scale,
                      E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, ROWS: tl.constexpr,
                      SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                      FIXED: tl.constexpr, FIXED_PAD: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ex = tl.arange(0, E_PAD)
        r_ok = rows < T
        e_ok = ex < E
        ok = r_ok[:, None] & e_ok[None, :]
        x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + ex[None, :], mask=ok,
                    other=float("-inf")).to(tl.float32)
        x = tl.where(r_ok[:, None], x, 0.0)  # rows past T: finite (never stored)
        if SOFTMAX:
            p = tl.exp(x - tl.max(x, 1)[:, None])
            p = tl.where(e_ok[None, :], p, 0.0)
            s = p / tl.sum(p, 1)[:, None]
        else:
            s = 1.0 / (1.0 + tl.exp(-x))
        choice = s
        if HAS_BIAS:
            choice = s + tl.load(bias_ptr + ex, mask=e_ok, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(choice != choice, float("inf"), choice)  # NaN ranks first, as in torch.topk
        choice = tl.where(e_ok[None, :], choice, float("-inf"))
        kk = tl.arange(0, K_PAD)
        w = tl.zeros([ROWS, K_PAD], tl.float32)
        ids = tl.zeros([ROWS, K_PAD], tl.int32)
        for j in tl.static_range(K):
            best = tl.max(choice, 1)
            # the lowest expert id among the row's best (never past the experts, whatever the row holds)
            pick = tl.minimum(tl.min(tl.where(choice == best[:, None], ex[None, :], E_PAD), 1), E - 1)
            hit = ex[None, :] == pick[:, None]
            wj = tl.sum(tl.where(hit, s, 0.0), 1)
            w = tl.where(kk[None, :] == j, wj[:, None], w)
            ids = tl.where(kk[None, :] == j, pick[:, None], ids)
            choice = tl.where(hit, float("-inf"), choice)
        if RENORM:
            w = w / tl.sum(w, 1)[:, None]
        w = w * scale
        out = rows.to(tl.int64)[:, None] * (K + FIXED) + kk[None, :]
        st = r_ok[:, None] & (kk[None, :] < K)
        tl.store(w_ptr + out, w, mask=st)
        tl.store(ids_ptr + out, ids.to(tl.int64), mask=st)
        if FIXED > 0:  # always-on experts E, E + 1, ... after the chosen ones, weight 1
            ff = tl.arange(0, FIXED_PAD)
            fo = rows.to(tl.int64)[:, None] * (K + FIXED) + K + ff[None, :]
            fm = r_ok[:, None] & (ff[None, :] < FIXED)
            tl.store(w_ptr + fo, tl.full([ROWS, FIXED_PAD], 1.0, tl.float32), mask=fm)
            tl.store(ids_ptr + fo, tl.broadcast_to((E + ff).to(tl.int64)[None, :], [ROWS, FIXED_PAD]), mask=fm)


def fused_topk_fits(topk) -> bool:
    """Whether the kernel computes `topk`'s rule (a `router.TopK`): built-in rule, no groups."""
    return (HAS_TRITON and topk.select_fn is None and topk.num_expert_group is None
            and topk.num_experts <= MAX_EXPERTS)


def route_config(num_tokens: int, num_experts: int) -> dict:
    """Tokens a program (ROWS) and its warps for a batch: one row a program up to a few thousand
    tokens, so that a decode batch spreads over the SMs (each row's k rounds of reductions are a
    serial chain: 16 rows on one warp leave a 130-token batch on 9 programs), a few rows past
    that (fewer programs to schedule)."""
    e_pad = triton.next_power_of_2(num_experts)
    rows = ROWS_SMALL if num_tokens <= ROWS_SWITCH else ROWS_LARGE
    return dict(ROWS=max(1, min(rows, 2048 // e_pad)), num_warps=1 if e_pad <= 128 else 4)


def fused_topk(logits: torch.Tensor, topk, correction_bias: torch.Tensor | None = None,
               config: dict | None = None, fixed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids int64 [T, k]) of `topk`'s rule (see the module docstring) for
    router logits [T, E]: `router.topk_select`'s result up to fp32 rounding of the scores
    (and the choice among exactly equal scores). `fixed` > 0 appends that many always-on
    experts to every row, ids E, E + 1, ... with weight 1 ([T, k + fixed]): shared experts
    stacked after the routed ones (`FusedMoE.stack_shared_experts`)."""
    if not fused_topk_fits(topk):
        raise ValueError(f"fused_topk computes the built-in rule without expert groups over at most "
                         f"{MAX_EXPERTS} experts; got {topk.extra_repr()}")
    T, E = logits.shape
    if E != topk.num_experts or logits.stride(1) != 1:
        raise ValueError(f"router logits {tuple(logits.shape)} (strides {logits.stride()}) are not "
                         f"[tokens, {topk.num_experts}] with contiguous rows")
    if correction_bias is not None:
        if correction_bias.numel() != E or correction_bias.device != logits.device:
            raise ValueError(f"correction_bias has {correction_bias.numel()} values on {correction_bias.device}: "
                             f"the router needs {E} on {logits.device}")
        correction_bias = correction_bias.reshape(E).contiguous()
    k, fixed = topk.top_k, int(fixed)
    if fixed < 0:
        raise ValueError(f"fixed={fixed} is invalid: always-on experts are a count >= 0")
    w = torch.empty(T, k + fixed, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k + fixed, dtype=torch.int64, device=logits.device)
    if T == 0:
        return w, ids
    cfg = {**route_config(T, E), **(config or {})}  # `config`: ROWS / num_warps (a sweep's overrides)
    bias = correction_bias if correction_bias is not None else logits
    _route_kernel[(triton.cdiv(T, cfg["ROWS"]),)](
        logits, bias, w, ids, T, E, logits.stride(0), topk.routed_scaling_factor,
        E_PAD=triton.next_power_of_2(E), K=k, K_PAD=triton.next_power_of_2(k), ROWS=cfg["ROWS"],
        SOFTMAX=topk.scoring == "softmax", HAS_BIAS=correction_bias is not None, RENORM=topk.renormalize,
        FIXED=fixed, FIXED_PAD=triton.next_power_of_2(max(fixed, 1)), num_warps=cfg["num_warps"])
    return w, ids
