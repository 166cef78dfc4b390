"""Torch reference of MLA over the latent cache, and the torch MLA backend (CPU).

Functions (no state): `write_latent_cache` (the cache write), `absorb_queries` /
`unabsorb_output` (W_UK in, W_UV out), `latent_decode_ref` (absorbed decode over the latent
cache: one shared "KV head" of dim R + P, values its first R dims), `expanded_keys` (the keys
of the expanded form: k_nope beside the shared k_pe), `expanded_prefill_ref`
(causal attention of a chunk over expanded keys / values, offset by the cached context).

`MLABackend.forward` is shared by the torch and Triton backends: it writes the step's latents,
runs the decode rows (one query token) in the absorbed form through `decode_latent` (what a
backend provides) and every other sequence (prefill chunks over any cached prefix, multi-token
steps) in the expanded form: their contexts' latents gathered from the cache in one index,
expanded by one `kv_b_proj` product, attended by `prefill` (here per sequence; the Triton
backend's one kernel launch for all of them).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from atom.model_engine.kv_cache import LatentAttentionSpec
from atom.model_ops.attention.metadata import get_forward_context
from atom.model_ops.attention.torch_native import dequantize, gather_blocks
from atom.model_ops.kernels.kv_cache import FP8_CACHE_DTYPES, quantize_fp8


def write_latent_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                       slot_mapping: torch.Tensor, step_cache: dict | None = None,
                       kv_scale: torch.Tensor | None = None) -> None:
    """[kv_c | k_pe] ([T, R], [T, P]) into cache [num_blocks, block_size, R + P] at `slot_mapping`
    (slots < 0 are padding and skipped; the check runs once per step where `step_cache` is given).
    An FP8 cache stores latent / kv_scale, saturated (`quantize_fp8`)."""
    T = kv_c.shape[0]
    if step_cache is not None and "latent_valid" in step_cache:
        valid = step_cache["latent_valid"]
    else:
        valid = slot_mapping[:T] >= 0
        valid = None if bool(valid.all()) else valid
        if step_cache is not None:
            step_cache["latent_valid"] = valid
    latent = torch.cat((kv_c, k_pe), dim=-1)
    slots = slot_mapping[:T]
    if valid is not None:
        latent, slots = latent[valid], slots[valid]
    rows = cache.view(-1, cache.shape[-1])
    if cache.dtype in FP8_CACHE_DTYPES:  # (CPU index_copy_ has no fp8 kernel: copy the bytes)
        rows.view(torch.uint8).index_copy_(0, slots, quantize_fp8(latent, kv_scale, cache.dtype).view(torch.uint8))
        return
    rows.index_copy_(0, slots, latent.to(cache.dtype))


def absorb_queries(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope], W_UK [H, nope, R] -> q_lat [T, H, R]."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)


def unabsorb_output(out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """out_lat [T, H, R], W_UV [H, v, R] -> [T, H, v], contiguous: the per-head products are
    written through a [H, T, v] view of it (cuBLAS takes the row stride H * v), so `o_proj`'s
    [T, H * v] input is a view, not a copy of a head-major result."""
    T, H, _ = out_lat.shape
    out = out_lat.new_empty(T, H, w_uv.shape[1])
    torch.bmm(out_lat.transpose(0, 1), w_uv.to(out_lat.dtype).transpose(1, 2), out=out.transpose(0, 1))
    return out


def latent_decode_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: list[int], scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence: q_lat [B, H, R], q_pe [B, H, P] over each sequence's
    `seq_lens[b]` cached latents -> out_lat [B, H, R] (fp32 softmax, q's dtype out). An FP8
    cache is read as fp8 * kv_scale."""
    B, H, R = q_lat.shape
    width = max(seq_lens)
    nb = -(-width // cache.shape[1])
    lat = gather_blocks(cache, block_tables[:, :nb].clamp_min(0))[:, :width]
    lat = dequantize(lat, kv_scale, q_lat.dtype)  # [B, W, R+P]
    q = torch.cat((q_lat, q_pe.to(q_lat.dtype)), dim=-1)  # [B, H, R+P]
    lens = torch.tensor(seq_lens, device=q.device)
    mask = (torch.arange(width, device=q.device)[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, W]
    # H query rows over one shared latent "head": [B, 1, H, R+P] x [B, 1, W, R+P]
    o = F.scaled_dot_product_attention(q[:, None], lat[:, None], lat[:, None, :, :R], attn_mask=mask, scale=scale)
    return o[:, 0]


def expanded_keys(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """k_nope [L, H, nope] and the heads' shared k_pe [L, rope] -> keys [L, H, nope + rope]."""
    k_pe = k_pe[:, None].expand(k_pe.shape[0], k_nope.shape[1], k_pe.shape[-1])
    return torch.cat((k_nope, k_pe.to(k_nope.dtype)), dim=-1)


def expanded_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, Dqk] (the last n of the L context tokens), k [L, H, Dqk], v [L, H, Dv] -> [n, H, Dv]."""
    n, L = q.shape[0], k.shape[0]
    qi, ki, vi = q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype)
    if L == n:
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
    else:  # causal, offset by the L - n cached tokens
        mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


class MLABackend:
    """What the torch and Triton MLA backends share: the spec, the split of a step into
    absorbed decodes and expanded prefills. Subclasses give `write_kv` and `decode_latent`."""
    name = "mla"

    def kv_cache_spec(self, layer, dtype: torch.dtype) -> LatentAttentionSpec:
        if dtype.itemsize < 2 and dtype not in FP8_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={str(dtype).removeprefix('torch.')} is not supported for MLA "
                             f"(latent) layers: the model's dtype or {FP8_CACHE_DTYPES[0]}")
        return LatentAttentionSpec(layer.latent_dim, dtype)

    def write_kv(self, layer, kv_c: torch.Tensor, k_pe: torch.Tensor, meta) -> None:
        raise NotImplementedError

    def decode_latent(self, layer, q_lat, q_pe, block_tables, seq_lens, seq_lens_host, meta) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _host_lists(meta):
        host = meta.step_cache.get("mla_host")
        if host is None:  # once per step, shared by all layers
            qlens = meta.query_lens_host or (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).tolist()
            slens = meta.seq_lens_host or meta.seq_lens.tolist()
            starts = [0, *itertools.accumulate(qlens)]
            dec = [i for i, n in enumerate(qlens) if n == 1]
            dev = meta.seq_lens.device
            dec_t = (torch.tensor(dec, device=dev), torch.tensor([starts[i] for i in dec], device=dev)) if dec else None
            host = meta.step_cache["mla_host"] = (qlens, slens, starts, dec, dec_t)
        return host

    def forward(self, layer, q_nope, q_pe, kv_c, k_pe) -> torch.Tensor:
        meta = get_forward_context()
        self.write_kv(layer, kv_c, k_pe, meta)
        T, H = q_nope.shape[:2]
        w_uk, w_uv = layer.absorb_weights()
        if meta.max_query_len == 1:  # every sequence decodes one token (CUDA graphs run this)
            q_lat = absorb_queries(q_nope, w_uk)
            out_lat = self.decode_latent(layer, q_lat, q_pe, meta.block_tables, meta.seq_lens,
                                         meta.seq_lens_host, meta)
            return unabsorb_output(out_lat, w_uv)
        qlens, slens, starts, dec, dec_t = self._host_lists(meta)
        out = q_nope.new_empty(T, H, layer.v_head_dim)
        if dec:
            seq_idx, tok = dec_t
            q_lat = absorb_queries(q_nope[tok], w_uk)
            out_lat = self.decode_latent(layer, q_lat, q_pe[tok], meta.block_tables[seq_idx], meta.seq_lens[seq_idx],
                                         [slens[i] for i in dec], meta)
            out[tok] = unabsorb_output(out_lat, w_uv)
        slots, spans = self._prefill_plan(meta, qlens, slens, starts, layer.kv_cache.shape[1])
        if spans:  # one gather and one kv_b_proj product for every prefill's context
            k_nope, k_pe, v = layer.expand_latent(self._gather_latents(layer, slots, q_nope.dtype))
            self.prefill(layer, q_nope, q_pe, k_nope, k_pe, v, spans, out, meta)
        return out

    def prefill(self, layer, q_nope, q_pe, k_nope, k_pe, v, spans, out, meta) -> None:
        """out[s:s + n] for each span (first query row s, n rows, context rows c..c + L): causal
        attention over the expanded context, one sequence at a time (the reference)."""
        q = torch.cat((q_nope, q_pe.to(q_nope.dtype)), dim=-1)
        k = expanded_keys(k_nope, k_pe)
        for s, n, c, L in spans:
            out[s:s + n] = expanded_prefill_ref(q[s:s + n], k[c:c + L], v[c:c + L], layer.scale)

    @staticmethod
    def _gather_latents(layer, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The cached latents at `slots` [L] -> [L, R + P] in `dtype` (fp8 * k_scale for an FP8 cache)."""
        rows = layer.kv_cache.view(-1, layer.latent_dim)
        if rows.dtype in FP8_CACHE_DTYPES:  # (no fp8 index_select on CPU: gather the bytes)
            return dequantize(rows.view(torch.uint8).index_select(0, slots).view(rows.dtype), layer.k_scale, dtype)
        return rows.index_select(0, slots)

    @staticmethod
    def _prefill_plan(meta, qlens, slens, starts, block_size: int):
        """Cache slots of every prefill sequence's context, concatenated, and per sequence
        (first query token, query tokens, first context row, context length); once per step."""
        plan = meta.step_cache.get("mla_prefill")
        if plan is None:
            pre = [i for i, n in enumerate(qlens) if n > 1]
            slots, spans = None, []
            if pre:
                dev = meta.block_tables.device
                lens = [slens[i] for i in pre]
                first = [0, *itertools.accumulate(lens)]
                lens_t = torch.tensor(lens, device=dev)
                rows = torch.repeat_interleave(torch.tensor(pre, device=dev), lens_t)
                pos = torch.arange(first[-1], device=dev) - torch.repeat_interleave(
                    torch.tensor(first[:-1], device=dev), lens_t)
                slots = meta.block_tables[rows, pos // block_size].long() * block_size + pos % block_size
                spans = [(starts[i], qlens[i], first[j], slens[i]) for j, i in enumerate(pre)]
            plan = meta.step_cache["mla_prefill"] = (slots, spans)
        return plan


class TorchMLABackend(MLABackend):
    name = "torch-mla"

    def write_kv(self, layer, kv_c, k_pe, meta) -> None:
        if layer.kv_cache.dtype in FP8_CACHE_DTYPES:
            layer.calibrate_kv_scales(kv_c, k_pe)
        write_latent_cache(kv_c, k_pe, layer.kv_cache, meta.slot_mapping, meta.step_cache, layer.k_scale)

    def decode_latent(self, layer, q_lat, q_pe, block_tables, seq_lens, seq_lens_host, meta) -> torch.Tensor:
        lens = seq_lens_host if seq_lens_host is not None else seq_lens.tolist()
        return latent_decode_ref(q_lat, q_pe, layer.kv_cache, block_tables, lens, layer.scale, layer.k_scale)

    def __repr__(self) -> str:
        return "TorchMLABackend()"
