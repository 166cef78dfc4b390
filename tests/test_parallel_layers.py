"""Tensor-parallel layers in one process (no collectives needed): each rank's parameters
are its shard of the checkpoint, for the unquantized method and the quantized ones (fp8,
int8, int4), and the ranks' products put together (concatenated for column-parallel
layers, summed for row-parallel ones) equal the unsplit layer's."""
from __future__ import annotations

import pytest
import torch

from atom.distributed.state import ParallelState, building
from atom.model_ops.embedding import LMHead, VocabEmbedding
from atom.model_ops.linear import MergedLinear, QKVLinear, RowParallelLinear
from test_quant_methods import FORMATS, OneSpec, dequant, q_int4


def ranks(world):
    return [ParallelState(rank=r, world_size=world) for r in range(world)]


def checkpoint(fmt, rows, cols, seed):
    """One shard's checkpoint tensors in format `fmt` (None: unquantized) and its fp32 weight."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.1
    if fmt is None:
        return {"weight": w}, w
    f = FORMATS[fmt]
    if "int4" in f:
        return q_int4(w, *f["int4"])
    t = f["quant"](w)
    if f["act"] == "fp8_static":
        t["input_scale"] = torch.tensor([0.002], dtype=torch.bfloat16)
    return t, dequant(t, fmt)


def load(layer, tensors, shard):
    for name, t in tensors.items():
        p = getattr(layer, name)
        p.weight_loader(p, t, shard)


def make(kind, fmt, tp=None):
    qc = OneSpec(FORMATS[fmt]["spec"]) if fmt else None
    if kind == "qkv":
        return QKVLinear(128, 32, 4, 2, quant_config=qc, prefix="t.qkv_proj", tp=tp)
    if kind == "merged":
        return MergedLinear(128, [64, 128], quant_config=qc, prefix="t.gate_up_proj", tp=tp)
    return RowParallelLinear(128, 64, bias=True, quant_config=qc, prefix="t.o_proj", tp=tp)


def built(kind, fmt, tp, tensors):
    layer = make(kind, fmt, tp)
    for sid, t in tensors.items():
        load(layer, t, sid)
    if layer.bias is not None:
        layer.bias.weight_loader(layer.bias, torch.arange(64, dtype=torch.float32) / 64, None)
    layer.method.process_weights_after_loading(layer)
    return layer


COLUMN_FORMATS = [None, "fp8_channel", "fp8_tensor_static", "fp8_block32", "int8", "int4_g32_sym", "int4_g64_asym"]
# row-parallel: formats whose activation quantization does not span the split (weight-only,
# or groups inside a rank's columns); per-token dynamic scales differ per rank by design
ROW_FORMATS = [None, "fp8_block32", "int4_g32_sym", "int4_g64_asym"]


@pytest.mark.parametrize("fmt", COLUMN_FORMATS)
@pytest.mark.parametrize("kind,world", [("qkv", 2), ("qkv", 4), ("merged", 2)])
def test_column_parallel_shards_and_products(kind, world, fmt):
    full = make(kind, None)
    tensors, deq = {}, {}
    for i, sid in enumerate(full.shard_ids()):
        rows = full.shard_range(sid)[1]
        tensors[sid], deq[sid] = checkpoint(fmt, rows, 128, seed=i)
    ref = built(kind, fmt, None, tensors)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(9))
    y_ref = ref(x)
    layers = [built(kind, fmt, tp, tensors) for tp in ranks(world)]
    for sid in full.shard_ids():
        start, size = ref.shard_range(sid)
        parts = []
        for layer in layers:
            s, n = layer.shard_range(sid)
            kv_replicated = kind == "qkv" and sid != "q" and world == 4  # 2 KV heads, 4 ranks: 1 head each
            assert n == (size // 2 if kv_replicated else size // world)
            parts.append(layer(x)[:, s:s + n])
        if kind == "qkv" and sid != "q" and world == 4:  # 2 KV heads on 4 ranks: each on 2 ranks
            assert torch.equal(parts[0], parts[1]) and torch.equal(parts[2], parts[3])
            parts = parts[::2]
        torch.testing.assert_close(torch.cat(parts, 1), y_ref[:, start:start + size])
    if fmt is None:  # the rank's rows of the checkpoint, exactly
        r1 = layers[1]
        q0, qn = r1.shard_range("q") if kind == "qkv" else r1.shard_range(0)
        src = tensors["q" if kind == "qkv" else 0]["weight"]
        assert torch.equal(r1.weight[q0:q0 + qn], src[qn:2 * qn])


@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_row_parallel_shards_sum_to_the_full_product(fmt):
    tensors = {None: checkpoint(fmt, 64, 128, seed=3)[0]}
    ref = built("row", fmt, None, tensors)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    layers = [built("row", fmt, tp, tensors) for tp in ranks(2)]
    assert all(layer.in_features == 64 for layer in layers)
    # the layer's forward all-reduces; here the ranks' partial products are summed by hand
    total = sum(layer.method.apply(layer, x[:, 64 * r:64 * (r + 1)]) for r, layer in enumerate(layers))
    torch.testing.assert_close(total, ref(x))
    assert torch.count_nonzero(layers[1].bias) == 0 and torch.equal(layers[0].bias, ref.bias)  # added once
    if fmt is None:
        assert torch.equal(layers[1].weight, tensors[None]["weight"][:, 64:])


def test_a_split_inside_a_quantization_block_is_refused():
    layer = MergedLinear(128, [96, 160], quant_config=OneSpec(FORMATS["fp8_block32"]["spec"]), prefix="t.gate_up",
                         tp=ParallelState(rank=1, world_size=2))
    t, _ = checkpoint("fp8_block32", 96, 128, 0)
    with pytest.raises(ValueError, match=r"t.gate_up.weight_scale.*inside an entry of 32.*tensor_parallel_size=2"):
        load(layer, t, 0)


def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        QKVLinear(128, 32, 4, 2, prefix="t", tp=ParallelState(rank=0, world_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size=4 is not a multiple of num_key_value_heads=3"):
        QKVLinear(128, 32, 12, 3, prefix="t", tp=ParallelState(rank=0, world_size=4))


def test_vocab_parallel_embedding_and_head_hold_their_rows():
    w = torch.randn(10, 8)
    with building(ParallelState(rank=1, world_size=4)):  # ceil(10 / 4) = 3 rows each; rank 1: 3..5
        emb, head = VocabEmbedding(10, 8), LMHead(10, 8)
    for m in (emb, head):
        m.weight.weight_loader(m.weight, w, None)
        assert m.weight.shape == (3, 8) and torch.equal(m.weight, w[3:6])
    last = VocabEmbedding(10, 8, tp=ParallelState(rank=3, world_size=4))  # rows 9 and a zero pad
    last.weight.weight_loader(last.weight, w, None)
    assert torch.equal(last.weight[0], w[9]) and not last.weight[1:].any()
    assert "rows [3, 6) of rank 1" in repr(emb)


def test_building_context_reaches_layers_and_is_left_behind():
    tp = ParallelState(rank=1, world_size=2)
    with building(tp):
        layer = MergedLinear(16, [8, 8])
    assert layer.tp is tp and layer.out_features == 8 and "tp=column:1/2" in repr(layer)
    assert MergedLinear(16, [8, 8]).tp.world_size == 1  # outside: one rank


def test_a_family_whose_layers_do_not_split_is_refused_before_any_process(tiny_llama, monkeypatch):
    from atom.config import Config
    from atom.distributed.executor import TensorParallelExecutor
    from atom.models.llama import LlamaForCausalLM
    monkeypatch.setattr(LlamaForCausalLM, "supports_tensor_parallel", False)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not implemented for LlamaForCausalLM"):
        TensorParallelExecutor(Config(tiny_llama, tensor_parallel_size=2))


def test_single_rank_layers_trace_into_one_graph():
    """At TP=1 the collectives are the identity before any compiler-disabled call: a model
    compiled as one graph (level 3, fullgraph) traces the row-parallel linear and the
    vocab-parallel embedding without a graph break."""
    tp = ParallelState.single()
    row = RowParallelLinear(16, 8, bias=False, prefix="t.o_proj", tp=tp)
    emb = VocabEmbedding(32, 16, tp=tp)
    with torch.no_grad():
        row.weight.normal_()
        emb.weight.normal_()

    def f(ids):
        return row(emb(ids))

    ids = torch.tensor([1, 5, 31])
    got = torch.compile(f, fullgraph=True, backend="eager")(ids)
    torch.testing.assert_close(got, f(ids))
    x = torch.randn(3, 4)
    torch.testing.assert_close(torch.compile(lambda x: tp.all_gather(tp.all_reduce(x)), fullgraph=True,
                                             backend="eager")(x), x)
