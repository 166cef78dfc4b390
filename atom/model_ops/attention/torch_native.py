"""Torch reference attention over the paged KV cache (the CPU backend).

Decodes are done together: every decoding sequence's context is gathered through its
block table into one padded tensor and attended in a single masked SDPA call. Prefills
(and chunked continuations) are done one sequence at a time, each with a causal mask
offset by its cached context length.

Per layer options (`AttentionOptions`): a sliding window W (a query at position p sees the
keys at p - W < j <= p, as transformers' `sliding_window` masks), attention sinks (a learned
logit per query head that joins the softmax denominator and carries no value, GPT-OSS),
and an FP8 cache: keys / values are stored as e4m3 of x / scale (clamped to +-448) and read
back as fp8 * scale with the layer's `k_scale` / `v_scale`.
"""
from __future__ import annotations

import itertools
import torch
import torch.nn.functional as F

from atom.model_ops.attention.metadata import AttentionMetadata
from atom.model_ops.attention.options import AttentionOptions
from atom.model_ops.kernels.kv_cache import FP8_CACHE_DTYPES as FP8_DTYPES, quantize_fp8


PLAIN = AttentionOptions()


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached keys / values in the compute dtype: fp8 * scale for an FP8 cache, else a cast."""
    if x.dtype in FP8_DTYPES:
        x = x.float()
        if scale is not None:
            x = x * scale
    return x.to(dtype)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, step_cache: dict | None = None,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at `slot_mapping`
    (slots < 0 are padding and skipped). `step_cache`: the step's dict, where the padding
    check is kept so that it runs once per step rather than once per layer. An FP8 cache
    stores key / k_scale and value / v_scale (`quantize_fp8`)."""
    if step_cache is not None and "kv_valid" in step_cache:
        valid = step_cache["kv_valid"]
    else:
        valid = slot_mapping >= 0
        valid = None if bool(valid.all()) else valid
        if step_cache is not None:
            step_cache["kv_valid"] = valid
    if valid is not None:
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    if kc.dtype in FP8_DTYPES:  # (CPU index_copy_ has no fp8 kernel: copy the bytes)
        key = quantize_fp8(key, k_scale, kc.dtype).view(torch.uint8)
        value = quantize_fp8(value, v_scale, vc.dtype).view(torch.uint8)
        kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
    kc.index_copy_(0, slot_mapping, key.to(kc.dtype))
    vc.index_copy_(0, slot_mapping, value.to(vc.dtype))


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, bs, Hkv, D] at block ids `tables` [..., nb] -> [..., nb * bs, Hkv, D].
    (index_select copies whole blocks; several times faster than advanced indexing on CPU)"""
    if cache.dtype in FP8_DTYPES:  # (no fp8 index_select on CPU: gather the bytes)
        return gather_blocks(cache.view(torch.uint8), tables).view(cache.dtype)
    rows = cache.view(cache.shape[0], -1).index_select(0, tables.reshape(-1))
    return rows.view(*tables.shape[:-1], tables.shape[-1] * cache.shape[1], *cache.shape[2:])


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[L, Hkv, D] context of one sequence."""
    nb = -(-length // cache.shape[1])
    return gather_blocks(cache, block_table[:nb])[:length]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
           causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of q [B, H, M, D] over k / v [B, Hk, N, D] (Hk divides H; GQA),
    `mask` True where a key is seen. Without sinks: SDPA. With `sinks` (broadcastable to
    [B, H, M, 1]) the sink logit is one more softmax column that carries no value (fp32 math)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    rep = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = q.float() @ kf.transpose(-1, -2) * scale
    if causal and mask is None:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril(s.shape[-1] - s.shape[-2])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.float().expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    return (p @ vf).to(q.dtype)


def _window_start(first_pos: int, window: int | None) -> int:
    """The first key a query at `first_pos` (or later) can see."""
    return 0 if window is None else max(0, first_pos - window + 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, opts: AttentionOptions = PLAIN) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; the new tokens' K/V must already be in the cache.
    `opts`: the layer's sliding window, sinks and FP8 scales (`AttentionOptions`)."""
    host = meta.step_cache.get("host_lists")
    if host is None:  # once per step, shared by all layers
        qlens = meta.query_lens_host or (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).tolist()
        slens = meta.seq_lens_host or meta.seq_lens.tolist()
        host = meta.step_cache["host_lists"] = (qlens, slens, [0, *itertools.accumulate(qlens)],
                                   [i for i, n in enumerate(qlens) if n == 1])
    qlens, slens, starts, decodes = host
    if len(decodes) == 1 == len(qlens):  # one decoding sequence: no row bookkeeping
        return _decode_one(q, k_cache, v_cache, meta.block_tables[0], slens[0], scale, opts)
    out = torch.empty_like(q)
    if decodes:
        _decode_batch(q, k_cache, v_cache, meta, scale, out, decodes, starts, slens, opts)
    W = opts.sliding_window
    sinks = None if opts.sinks is None else opts.sinks.view(1, -1, 1, 1)
    for i, n in enumerate(qlens):
        if n <= 1:
            continue
        s, L = starts[i], slens[i]
        lo = _window_start(L - n, W)  # keys below lo are outside every query's window
        k = dequantize(_gather(k_cache, meta.block_tables[i], L)[lo:], opts.k_scale, q.dtype)
        v = dequantize(_gather(v_cache, meta.block_tables[i], L)[lo:], opts.v_scale, q.dtype)
        # 4-D inputs: CPU SDPA takes its flash kernel (3-D GQA inputs fall back to the slow math path)
        qi = q[s:s + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        ki, vi = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        mask = None
        if L != n or W is not None:  # causal, offset by the L - n cached tokens; the window
            qpos = torch.arange(L - n, L, device=q.device)[:, None]
            kpos = torch.arange(lo, L, device=q.device)[None, :]
            mask = kpos <= qpos
            if W is not None:
                mask = mask & (kpos > qpos - W)
        o = attend(qi, ki, vi, scale, mask, causal=True, sinks=sinks)
        out[s:s + n] = o[0].transpose(0, 1)
    return out


def _fold_heads(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Decode queries [B, Hq, D] -> [B, Hkv, Hq/Hkv, D]: the query heads sharing a KV head become
    that head's query rows, so SDPA needs no GQA expansion of K/V (a little faster on CPU)."""
    B, Hq, D = q.shape
    return q.reshape(B, num_kv_heads, Hq // num_kv_heads, D)


def _folded_sinks(opts: AttentionOptions, num_kv_heads: int) -> torch.Tensor | None:
    """Sinks [Hq] as [1, Hkv, G, 1], matching `_fold_heads`."""
    return None if opts.sinks is None else opts.sinks.view(1, num_kv_heads, -1, 1)


def _decode_one(q, k_cache, v_cache, block_table, length, scale, opts: AttentionOptions = PLAIN) -> torch.Tensor:
    lo = _window_start(length - 1, opts.sliding_window)
    k = dequantize(_gather(k_cache, block_table, length)[lo:], opts.k_scale, q.dtype)[None].transpose(1, 2)
    v = dequantize(_gather(v_cache, block_table, length)[lo:], opts.v_scale, q.dtype)[None].transpose(1, 2)
    o = attend(_fold_heads(q, k.shape[1]), k, v, scale, sinks=_folded_sinks(opts, k.shape[1]))  # [1, Hkv, G, D]
    return o.reshape(q.shape)


def _decode_plan(meta: AttentionMetadata, idx: list[int], starts: list[int], slens: list[int],
                 block_size: int, device, window: int | None = None) -> list[tuple]:
    """Gather indices and masks for the decode rows, built once per step and window (all
    layers with that window share it). Rows are grouped by context length so that short
    contexts are not padded to the longest one: a new group starts where the length falls
    below 3/4 of the group's longest. A window masks the keys before each row's window."""
    key = f"decode_plan:{window}"
    plan = meta.step_cache.get(key)
    if plan is not None:
        return plan
    order = sorted(idx, key=lambda i: slens[i], reverse=True)
    groups, group = [], [order[0]]
    for i in order[1:]:
        if slens[i] < 0.75 * slens[group[0]] and len(groups) < 3:
            groups.append(group)
            group = []
        group.append(i)
    groups.append(group)
    plan = []
    for g in groups:
        lens = [slens[i] for i in g]
        nb = -(-lens[0] // block_size)
        tables = meta.block_tables[torch.tensor(g, device=device), :nb].clamp_min(0)
        # a group of one is cut to its length; a larger group is masked (slicing it is slower)
        width, mask = (lens[0] if len(g) == 1 else nb * block_size), None
        if min(lens) < width or (window is not None and lens[0] > window):
            lens_t = torch.tensor(lens, device=device)[:, None]
            j = torch.arange(width, device=device)[None, :]
            keep = j < lens_t
            if window is not None:
                keep = keep & (j >= lens_t - window)
            mask = keep[:, None, None, :]
        plan.append((tables, mask, width, torch.tensor([starts[i] for i in g], device=device)))
    meta.step_cache[key] = plan
    return plan


def _decode_batch(q, k_cache, v_cache, meta, scale, out, idx, starts, slens, opts: AttentionOptions = PLAIN):
    for tables, mask, width, tok in _decode_plan(meta, idx, starts, slens, k_cache.shape[1], q.device,
                                                 opts.sliding_window):
        k = dequantize(gather_blocks(k_cache, tables)[:, :width], opts.k_scale, q.dtype)  # [B, width, Hkv, D]
        v = dequantize(gather_blocks(v_cache, tables)[:, :width], opts.v_scale, q.dtype)
        qd = _fold_heads(q[tok], k.shape[2])  # [B, Hkv, G, D]
        o = attend(qd, k.transpose(1, 2), v.transpose(1, 2), scale, mask, sinks=_folded_sinks(opts, k.shape[2]))
        out[tok] = o.reshape(len(tok), *q.shape[1:])
