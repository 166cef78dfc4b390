"""Torch reference attention over the paged KV cache (the CPU backend).

Decodes are done together: every decoding sequence's context is gathered through its
block table into one padded tensor and attended in a single masked SDPA call. Prefills
(and chunked continuations) are done one sequence at a time, each with a causal mask
offset by its cached context length.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from atom.model_ops.attention.metadata import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, step_cache: dict | None = None) -> None:
    """key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at `slot_mapping`
    (slots < 0 are padding and skipped). `step_cache`: the step's dict, where the padding
    check is kept so that it runs once per step rather than once per layer."""
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
    kc.index_copy_(0, slot_mapping, key.to(kc.dtype))
    vc.index_copy_(0, slot_mapping, value.to(vc.dtype))


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, bs, Hkv, D] at block ids `tables` [..., nb] -> [..., nb * bs, Hkv, D].
    (index_select copies whole blocks; several times faster than advanced indexing on CPU)"""
    rows = cache.view(cache.shape[0], -1).index_select(0, tables.reshape(-1))
    return rows.view(*tables.shape[:-1], tables.shape[-1] * cache.shape[1], *cache.shape[2:])


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[L, Hkv, D] context of one sequence."""
    nb = -(-length // cache.shape[1])
    return gather_blocks(cache, block_table[:nb])[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; the new tokens' K/V must already be in the cache."""
    host = meta.step_cache.get("host_lists")
    if host is None:  # once per step, shared by all layers
        qlens = meta.query_lens_host or (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).tolist()
        slens = meta.seq_lens_host or meta.seq_lens.tolist()
        host = meta.step_cache["host_lists"] = (qlens, slens, [0, *itertools.accumulate(qlens)],
                                   [i for i, n in enumerate(qlens) if n == 1])
    qlens, slens, starts, decodes = host
    if len(decodes) == 1 == len(qlens):  # one decoding sequence: no row bookkeeping
        return _decode_one(q, k_cache, v_cache, meta.block_tables[0], slens[0], scale)
    out = torch.empty_like(q)
    if decodes:
        _decode_batch(q, k_cache, v_cache, meta, scale, out, decodes, starts, slens)
    for i, n in enumerate(qlens):
        if n <= 1:
            continue
        s, L = starts[i], slens[i]
        k = _gather(k_cache, meta.block_tables[i], L).to(q.dtype)
        v = _gather(v_cache, meta.block_tables[i], L).to(q.dtype)
        # 4-D inputs: CPU SDPA takes its flash kernel (3-D GQA inputs fall back to the slow math path)
        qi = q[s:s + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        ki, vi = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if L == n:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:  # causal, offset by the L - n cached tokens
            qpos = torch.arange(L - n, L, device=q.device)
            mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:s + n] = o[0].transpose(0, 1)
    return out


def _fold_heads(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Decode queries [B, Hq, D] -> [B, Hkv, Hq/Hkv, D]: the query heads sharing a KV head become
    that head's query rows, so SDPA needs no GQA expansion of K/V (a little faster on CPU)."""
    B, Hq, D = q.shape
    return q.reshape(B, num_kv_heads, Hq // num_kv_heads, D)


def _decode_one(q, k_cache, v_cache, block_table, length, scale) -> torch.Tensor:
    k = _gather(k_cache, block_table, length).to(q.dtype)[None].transpose(1, 2)  # [1, Hkv, L, D]
    v = _gather(v_cache, block_table, length).to(q.dtype)[None].transpose(1, 2)
    o = F.scaled_dot_product_attention(_fold_heads(q, k.shape[1]), k, v, scale=scale)  # [1, Hkv, G, D]
    return o.reshape(q.shape)


def _decode_plan(meta: AttentionMetadata, idx: list[int], starts: list[int], slens: list[int],
                 block_size: int, device) -> list[tuple]:
    """Gather indices and masks for the decode rows, built once per step (all layers share
    it). Rows are grouped by context length so that short contexts are not padded to the
    longest one: a new group starts where the length falls below 3/4 of the group's longest."""
    plan = meta.step_cache.get("decode_plan")
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
        if min(lens) < width:
            lens_t = torch.tensor(lens, device=device)
            mask = (torch.arange(width, device=device)[None, :] < lens_t[:, None])[:, None, None, :]
        plan.append((tables, mask, width, torch.tensor([starts[i] for i in g], device=device)))
    meta.step_cache["decode_plan"] = plan
    return plan


def _decode_batch(q, k_cache, v_cache, meta, scale, out, idx, starts, slens):
    for tables, mask, width, tok in _decode_plan(meta, idx, starts, slens, k_cache.shape[1], q.device):
        k = gather_blocks(k_cache, tables)[:, :width].to(q.dtype)  # [B, width, Hkv, D]
        v = gather_blocks(v_cache, tables)[:, :width].to(q.dtype)
        qd = _fold_heads(q[tok], k.shape[2])  # [B, Hkv, G, D]
        o = F.scaled_dot_product_attention(qd, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
        out[tok] = o.reshape(len(tok), *q.shape[1:])
