"""`kv_cache_dtype="fp8"` in the engine: e4m3 keys and values, the block count the smaller
entries allow, scales from the checkpoint, and the model's outputs beside transformers'.

The exact reference is transformers with its keys / values rounded to e4m3 in its attention
(`hf_with_fp8_kv`): the engine's FP8 cache gives its logits (to fp32 noise) and its greedy
tokens. Beside plain transformers exact tokens are not expected: an e4m3 entry keeps 3
mantissa bits (up to 6% relative error each), and the tiny random models (initializer range
0.45, chosen so that greedy tokens are decisive) amplify that much: logits move by up to ~2x
their spread at some positions, so there only a majority of argmax agreement is asserted."""
import shutil

import pytest
import torch
import transformers

from atom import LLM, SamplingParams
from atom.model_engine.kv_cache import KVCacheManager, kv_cache_dtype_of
from atom.model_engine.sequence import Sequence
from atom.model_ops.attention import Attention
from atom.viz import kv_cache_frame
from conftest import hf_greedy
from tiny_attention import add_kv_scales, hf_with_fp8_kv

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(lens=(5, 30, 70), seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]


def engine_logits(runner, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position of `ids`, prefilled in chunks of `chunk` tokens through the
    paged cache (later chunks read the earlier ones' cached K/V)."""
    s = Sequence(list(ids))
    s.block_table = list(range(-(-len(ids) // runner.block_size)))
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            s.num_computed_tokens, s.num_new_tokens = start, min(chunk, len(ids) - start)
            input_ids, positions, meta = runner.to_device(runner.prepare_host([s]))
            out.append(runner.model.compute_logits(runner.forward(input_ids, positions, meta)).float())
    return torch.cat(out)


def layer_scales(runner) -> dict:
    """{layer index: (k_scale, v_scale)} the engine's attention layers hold now."""
    return {a.layer_idx: (float(a.k_scale), float(a.v_scale)) for a in runner.attn_layers}


def hf_logits(path, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_fp8_spec_halves_the_page_so_the_same_memory_holds_twice_the_blocks():
    layers = {i: Attention(8, 2, 64, 0.125, i) for i in range(3)}
    budget = 3 * 2**20
    counts = {}
    for kv in ("bf16", "fp8"):
        dtype = kv_cache_dtype_of(kv, torch.bfloat16)
        m = KVCacheManager({i: (a, a.kv_cache_spec(dtype)) for i, a in layers.items()}, block_size=16)
        counts[kv] = m.num_blocks_for(budget)
        m.allocate(counts[kv])
        assert all(a.k_cache.dtype == dtype for a in layers.values())
        frame = m.to_frame()
        assert (frame["dtype"] == str(dtype)[6:]).all()
        assert (frame["bytes_per_token"] == 2 * 2 * 64 * dtype.itemsize).all()  # K and V, 2 heads x 64
        assert m.nbytes <= budget
    assert counts["fp8"] == 2 * counts["bf16"] and counts["bf16"] > 0
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4' is invalid"):
        kv_cache_dtype_of("fp4", torch.bfloat16)


def test_fp8_engine_allocates_fp8_and_twice_the_blocks_from_memory(tiny_llama, monkeypatch):
    """The automatic block count (from the CPU's KV budget, made small here so that the
    max_num_seqs cap does not bind) of a bf16 model: twice with FP8 entries."""
    from atom.model_engine import model_runner
    monkeypatch.setattr(model_runner, "CPU_KV_CACHE_BYTES", 8 << 20)
    kw = dict(enable_log_stats=False, dtype="bfloat16", max_num_seqs=256, max_model_len=1024)
    runners = {kv: LLM(tiny_llama, kv_cache_dtype=kv, **kw).engine.runner for kv in ("bf16", "fp8")}
    bf16, fp8 = runners["bf16"], runners["fp8"]
    assert bf16.kv_bytes_per_block == 2 * fp8.kv_bytes_per_block
    assert fp8.num_blocks == 2 * bf16.num_blocks
    assert fp8.attn_layers[0].k_cache.dtype == torch.float8_e4m3fn
    assert bf16.attn_layers[0].k_cache.dtype == torch.bfloat16
    frame = kv_cache_frame(fp8)
    assert set(frame["dtype"]) == {"float8_e4m3fn"} and set(frame["scale_source"]) == {"pending (first prefill)"}


def test_fp8_kv_logits_match_transformers_with_fp8_kv(tiny_llama):
    """Teacher-forced logits over 70 positions, as one prefill and as chunks of 16 over the
    FP8 cache: those of transformers with e4m3 keys / values; the bf16-cache engine gives
    plain transformers' logits, and FP8 moves them (the check can fail)."""
    ids = _prompts((70,), seed=11)[0]
    ref = hf_logits(tiny_llama, ids)
    bf16 = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=16).engine.runner
    torch.testing.assert_close(engine_logits(bf16, ids, 70), ref, rtol=1e-4, atol=1e-4)
    fp8 = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=16, kv_cache_dtype="fp8").engine.runner
    first = engine_logits(fp8, ids, 70)  # computes the scales (no checkpoint ones) from these keys / values
    ref8 = hf_with_fp8_kv(tiny_llama, layer_scales(fp8))(torch.tensor([ids])).logits[0].detach()
    torch.testing.assert_close(first, ref8, rtol=1e-4, atol=1e-4)
    for chunk in (70, 16):
        got = engine_logits(fp8, ids, chunk)
        torch.testing.assert_close(got, ref8, rtol=1e-4, atol=1e-4)
        assert (got - ref).abs().max() > 0.1, "the FP8 cache made no difference: is it quantizing?"
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert top1 >= 0.6, f"top-1 agreement with the unquantized model {top1:.0%}"  # measured 77%


def test_fp8_kv_greedy_tokens_match_transformers_with_fp8_kv(tiny_llama, tiny_qwen3):
    """Prefix caching and chunked prefill over the FP8 cache: transformers' greedy tokens
    with e4m3 keys / values, exactly (Llama and Qwen3, prompts of 5-70 tokens)."""
    ps = _prompts()
    for path in (tiny_llama, tiny_qwen3):
        llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=64, kv_cache_dtype="fp8",
                  enable_prefix_caching=True, max_num_batched_tokens=32)
        got = [o.token_ids for o in llm.generate(ps + ps[1:], GREEDY, use_tqdm=False)]
        hf8 = hf_with_fp8_kv(path, layer_scales(llm.engine.runner))  # the scales the first step computed
        ref = [hf_greedy(hf8, p, GREEDY.max_tokens) for p in ps]
        assert got == ref + ref[1:]


def test_checkpoint_kv_scales_are_loaded_and_used(tiny_llama, tmp_path):
    """k_scale / v_scale from the checkpoint reach the layers (both namings) and the cache:
    tiny scales saturate the FP8 entries and change the outputs exactly as setting the same
    scales by hand does; a bf16 cache ignores them."""
    ids = _prompts((40,), seed=5)[0]
    scales = {0: (0.002, 0.003), 1: (0.004, 0.001)}
    plain = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=16, kv_cache_dtype="fp8").engine.runner
    base = engine_logits(plain, ids, 40)
    for layer, (ks, vs) in scales.items():  # the same scales, by hand
        plain.attn_layers[layer].k_scale.fill_(ks)
        plain.attn_layers[layer].v_scale.fill_(vs)
        plain.attn_layers[layer].kv_scale_pending = False
    by_hand = engine_logits(plain, ids, 40)
    assert (by_hand - base).abs().max() > 1.0, "these scales should saturate and move the logits"
    for naming in ("self_attn", "output_scale"):
        path = tmp_path / naming
        shutil.copytree(tiny_llama, path)
        add_kv_scales(str(path), scales, naming)
        runner = LLM(str(path), enable_log_stats=False, num_kvcache_blocks=16, kv_cache_dtype="fp8").engine.runner
        frame = kv_cache_frame(runner)
        assert list(frame["k_scale"]) == pytest.approx([0.002, 0.004]) and set(frame["scale_source"]) == {"checkpoint"}
        torch.testing.assert_close(engine_logits(runner, ids, 40), by_hand, rtol=0, atol=0)
        bf16 = LLM(str(path), enable_log_stats=False, num_kvcache_blocks=16).engine.runner
        torch.testing.assert_close(engine_logits(bf16, ids, 40), hf_logits(tiny_llama, ids), rtol=1e-4, atol=1e-4)


def test_scales_without_a_checkpoint_are_computed_from_the_first_prefill(tiny_llama):
    """No checkpoint scales: the first cache write (a real prefill, after start-up) sets each
    layer's k_scale / v_scale to amax(|k|) / 200 and amax(|v|) / 100 of that step, once; a
    bf16 cache arms nothing."""
    from atom.model_ops.attention import K_SCALE_RANGE, V_SCALE_RANGE
    ids = _prompts((40,), seed=7)[0]
    runner = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=16, kv_cache_dtype="fp8").engine.runner
    assert all(a.kv_scale_pending and float(a.k_scale) == 1.0 for a in runner.attn_layers)
    seen = {}

    def first_kv(m, args):  # this layer's keys / values at its first call (returns None: args kept)
        seen.setdefault(m.layer_idx, (args[1].abs().max().item(), args[2].abs().max().item()))
    hooks = [a.register_forward_pre_hook(first_kv) for a in runner.attn_layers]
    engine_logits(runner, ids, 40)
    for h in hooks:
        h.remove()
    for a in runner.attn_layers:
        kmax, vmax = seen[a.layer_idx]
        assert float(a.k_scale) == pytest.approx(kmax / K_SCALE_RANGE) and float(a.k_scale) != 1.0
        assert float(a.v_scale) == pytest.approx(vmax / V_SCALE_RANGE)
        assert not a.kv_scale_pending and a.kv_scale_source == "computed"
    before = layer_scales(runner)
    engine_logits(runner, [i + 1 for i in ids], 40)  # later steps keep them
    assert layer_scales(runner) == before and set(kv_cache_frame(runner)["scale_source"]) == {"computed"}
    bf16 = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=16).engine.runner
    assert bf16.arm_kv_scale_calibration() == 0 and not any(a.kv_scale_pending for a in bf16.attn_layers)


def test_per_head_kv_scales_are_refused_with_the_tensor_name(tiny_llama, tmp_path):
    from safetensors.torch import save_file
    path = tmp_path / "per_head"
    shutil.copytree(tiny_llama, path)
    save_file({"model.layers.0.self_attn.k_scale": torch.ones(2)}, str(path / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_scale.*one scale per layer"):
        LLM(str(path), enable_log_stats=False, num_kvcache_blocks=16, kv_cache_dtype="fp8")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_kv_on_the_triton_backend_matches_the_torch_backend(tiny_qwen3, compiled):
    """The engine's Triton attention op (interpreter) over an FP8 cache, every fusion on:
    the same greedy tokens as the torch backend over an FP8 cache (both quantize the same
    way; the rotary / GEMV cache writes are declined for FP8, the decode kernel quantizes).
    Compiled (level 3's graph, traced by AOT autograd): the rotary op then leaves the cache
    write to the backend's quantizing write."""
    pytest.importorskip("triton")
    import torch
    from test_triton_engine import _on_triton
    ps = [[5, 6, 7, 8, 9], list(range(10, 50))]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    kw = dict(enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32, kv_cache_dtype="fp8")
    want = [o.token_ids for o in LLM(tiny_qwen3, **kw).generate(ps, sp, use_tqdm=False)]
    llm = LLM(tiny_qwen3, **kw)
    runner = llm.engine.runner
    _on_triton(runner, fused=True)
    if compiled:
        torch._dynamo.reset()
        runner.model_forward = torch.compile(runner.model, backend="aot_eager", dynamic=True, fullgraph=True)
    try:
        assert [o.token_ids for o in llm.generate(ps, sp, use_tqdm=False)] == want
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_latent_cache_greedy_tokens_match_transformers_with_fp8_latents(tmp_path, monkeypatch, backend):
    """DeepSeek-V2 (MLA) over an FP8 latent cache, prefix caching and chunked prefill on, the
    scales computed from the first prefill: transformers' greedy tokens when its latents are
    rounded to e4m3 the same way, on the torch reference backend and on the Triton one
    (interpreter); the cache is e4m3 and holds twice the blocks of a bf16 one in a budget."""
    from tiny_deepseek import hf_v2_with_fp8_latent, make_tiny_deepseek
    path = make_tiny_deepseek(tmp_path / "ds", "v2")
    ps = _prompts()
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=64, kv_cache_dtype="fp8",
              enable_prefix_caching=True, max_num_batched_tokens=32)
    runner = llm.engine.runner
    if backend == "triton":
        pytest.importorskip("triton")
        from atom.model_ops.attention.mla_torch import MLABackend
        from atom.model_ops.attention.mla_triton import TritonMLABackend
        triton_backend = TritonMLABackend(runner.attn_layers, 64, runner.device)
        # the prompts' attention by the per-sequence reference: a latent rounds to e4m3 exactly
        # as in transformers only if it was computed in the same fp32 order, and the prefill
        # kernel's online softmax (~1e-5 away: tests/test_mla.py) moves some latents across a
        # rounding boundary (and the computed scales by an ulp), so greedy tokens part at
        # near-ties; the FP8 write, gather and decode kernels stay in this exact check
        monkeypatch.setattr(triton_backend, "prefill", lambda *a: MLABackend.prefill(triton_backend, *a))
        runner.set_attention_backend(triton_backend)
    assert {a.kv_cache.dtype for a in runner.attn_layers} == {torch.float8_e4m3fn}
    assert runner.kv_cache_manager.bytes_per_block * 2 == KVCacheManager(
        {i: (a, a.kv_cache_spec(torch.bfloat16)) for i, a in enumerate(runner.attn_layers)},
        runner.block_size).bytes_per_block
    got = [o.token_ids for o in llm.generate(ps + ps[1:], GREEDY, use_tqdm=False)]
    scales = {a.layer_idx: float(a.k_scale) for a in runner.attn_layers}
    assert all(a.kv_scale_source == "computed" for a in runner.attn_layers) and len(set(scales.values())) > 1
    frame = kv_cache_frame(llm)  # the notebook view: one latent scale per layer, no value scale
    assert list(frame["k_scale"]) == list(scales.values()) and frame["v_scale"].isna().all()
    hf8 = hf_v2_with_fp8_latent(path, scales, monkeypatch)
    ref = [hf_greedy(hf8, p, GREEDY.max_tokens) for p in ps]
    assert got == ref + ref[1:]
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # the rounding is real: transformers' own logits move
        seq = torch.tensor([ps[2] + ref[2]])
        assert (hf8(seq).logits - plain(seq).logits).abs().max() > 1e-2


def test_checkpoint_latent_scale_is_loaded_and_a_value_scale_refused(tmp_path):
    from safetensors.torch import save_file
    from tiny_deepseek import make_tiny_deepseek
    path = make_tiny_deepseek(tmp_path / "ds", "v2")
    save_file({"model.layers.1.self_attn.k_scale": torch.tensor(0.05)}, f"{path}/kv_scales.safetensors")
    runner = LLM(path, enable_log_stats=False, num_kvcache_blocks=16, kv_cache_dtype="fp8").engine.runner
    layer = runner.attn_layers[1]
    assert float(layer.k_scale) == pytest.approx(0.05) and layer.kv_scale_source == "checkpoint"
    save_file({"model.layers.1.self_attn.v_scale": torch.tensor(0.05)}, f"{path}/kv_scales.safetensors")
    with pytest.raises(ValueError, match=r"self_attn.v_scale.*one scale for its latent"):
        LLM(path, enable_log_stats=False, num_kvcache_blocks=16, kv_cache_dtype="fp8")
