"""The core seams on the CPU: a kernel plan per engine (built, saved, loaded, applied), two
engines in one process, a method per linear layer (and the table of them), and a KV-cache
manager allocating layers of two kinds of spec at once."""
import pytest
import torch
import transformers

from atom import LLM, SamplingParams
from conftest import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50))]


def _hf_tokens(path, prompts=PROMPTS, n=5):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, n) for p in prompts]


def _tokens(llm, prompts=PROMPTS):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _one_at_a_time(llm):
    """The short prompt alone, so that decode steps are one row (the GEMV's case)."""
    return _tokens(llm, PROMPTS[:1])


def test_kernel_plan_saved_loaded_and_applied_gives_the_same_tokens(tiny_llama, tmp_path, monkeypatch):
    """A plan with every fusion and a GEMV entry for every one-row product (what a GPU
    start-up may choose), run by Triton's interpreter: saved, loaded into a second engine and
    installed there, the tokens are transformers' in both engines; the loaded plan equals the
    saved one and prints what it holds."""
    pytest.importorskip("triton")
    from atom.model_ops.attention.triton_backend import TritonAttentionBackend
    import importlib
    gemv, gemv_rope = (importlib.import_module(f"atom.model_ops.kernels.{m}") for m in ("gemv", "gemv_rope"))
    from atom.tuning.fusions import default_fusions
    from atom.tuning.gemv_choice import one_row_variants
    from atom.tuning.plan import KernelPlan
    ref = _hf_tokens(tiny_llama, PROMPTS[:1])
    calls = []
    for mod, name in ((gemv_rope, "gemv_norm_rope"), (gemv, "gemv_fused")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    engines = []
    for _ in range(2):
        llm = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32,
                  enforce_eager=True)
        runner = llm.engine.runner
        runner.set_attention_backend(TritonAttentionBackend(runner.attn_layers, 64, runner.device))
        engines.append(llm)
    plan = KernelPlan(backend="triton", fusions=default_fusions("triton"), force_kernels=True)
    first = engines[0].engine.runner
    first.install_plan(plan)
    for m in first.model.modules():
        for variant in one_row_variants(m):
            plan.gemv[(m.weight.shape[0], m.weight.shape[1], m.weight.dtype, variant)] = {}  # {}: the default tiling
    plan.gemv_timings = {k: (2.0, 1.0) for k in plan.gemv}
    assert len(plan.gemv) == 6  # qkv (norm, norm+rope), gate-up (norm+silu), o, down and the LM head (plain)
    assert _one_at_a_time(engines[0]) == ref
    assert {"gemv_norm_rope", "gemv_fused"} <= set(calls)  # the plan's one-row kernels ran
    calls.clear()
    path = plan.save(tmp_path / "plan.json")
    loaded = KernelPlan.load(path)
    loaded.force_kernels = True
    assert loaded.to_dict() == plan.to_dict()
    assert f"gemv={len(plan.gemv)}/{len(plan.gemv)}" in repr(loaded)
    frame = loaded.to_frame()
    assert set(frame["variant"]) == {"plain", "norm", "norm+silu", "norm+rope"} and (frame["runs"] == "triton-gemv").all()
    second = engines[1].engine.runner
    second.install_plan(loaded)
    assert all(m.plan is loaded for m in second.model.modules() if "plan" in m.__dict__)
    assert all(m.plan is plan for m in first.model.modules() if "plan" in m.__dict__)
    layer = second.model.model.layers[0]
    assert "forward" in layer.__dict__  # the fused forward is installed
    assert _one_at_a_time(engines[1]) == ref
    assert {"gemv_norm_rope", "gemv_fused"} <= set(calls)


def test_a_plan_refuses_unknown_backends_and_fusions():
    from atom.tuning.plan import KernelPlan
    with pytest.raises(ValueError, match="backend='cuda' is invalid"):
        KernelPlan(backend="cuda")
    with pytest.raises(ValueError, match=r"fusions=\['magic'\] are invalid"):
        KernelPlan(fusions=("magic",))


def test_two_engines_in_one_process(tiny_llama, tiny_qwen3):
    """Two engines built one after the other, one on the Triton attention backend (the
    interpreter) and one on torch (on a GPU both on Triton, with CUDA graphs), used in turns:
    each keeps its own layers, caches, attention scratch and plan, and each gives
    transformers' tokens."""
    pytest.importorskip("triton")
    from atom.model_ops.attention.triton_backend import TritonAttentionBackend
    a = LLM(tiny_qwen3, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32)
    ra = a.engine.runner
    ra.set_attention_backend(TritonAttentionBackend(ra.attn_layers, 64, ra.device))
    ref_a = _hf_tokens(tiny_qwen3)
    assert _tokens(a) == ref_a
    b = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=48)
    rb = b.engine.runner
    ref_b = _hf_tokens(tiny_llama)
    assert _tokens(b) == ref_b
    assert _tokens(a) == ref_a  # the first engine after the second was built and ran
    assert ra.plan is not rb.plan and ra.attn_backend is not rb.attn_backend
    assert ra.attn_backend.layers == ra.attn_layers
    assert rb.attn_backend.name == ("triton" if rb.device.type == "cuda" else "torch")
    if rb.device.type == "cuda":  # each engine's attention op has its own layers and scratch
        assert rb.attn_backend.layers == rb.attn_layers and rb.attn_backend.workspace is not ra.attn_backend.workspace
    assert ra.kv_cache_manager.num_blocks == 32 and rb.kv_cache_manager.num_blocks == 48
    assert all(x.k_cache.data_ptr() != y.k_cache.data_ptr() for x, y in zip(ra.attn_layers, rb.attn_layers))
    assert _tokens(b) == ref_b


def test_a_method_per_linear_layer_as_a_table(tiny_llama):
    """Every linear layer (and the LM head) has its method; the table names each with its
    method, format and bytes, which add up to the weights the layers hold."""
    from atom.viz import linear_methods_frame
    llm = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=16)
    model = llm.engine.runner.model
    df = linear_methods_frame(llm)
    assert list(df.columns[:5]) == ["layer", "class", "method", "format", "bytes"]
    layers = model.config.num_hidden_layers
    assert len(df) == 4 * layers + 1  # qkv, o, gate-up, down per layer + the LM head
    assert set(df["method"]) == {"unquantized"} and set(df["format"]) == {"float32"}
    qkv = df[df.layer == "model.layers.0.self_attn.qkv_proj"].iloc[0]
    w = model.model.layers[0].self_attn.qkv_proj.weight
    assert qkv["bytes"] == w.numel() * 4 and qkv["class"] == "QKVLinear"
    assert "method=unquantized" in repr(model.model.layers[0].self_attn.qkv_proj)


def test_quantized_layers_are_refused_with_their_name_and_the_remap_reaches_packed_layers(tiny_llama):
    """A checkpoint that excludes its q/k/v, gate/up (by the checkpoint's names) and o/down
    from an fp8 format: the runner remaps the names onto the packed layers, so the model
    builds unquantized; without the remap the packed q/k/v layer asks for fp8 and is refused
    naming the layer and the format."""
    from atom.config import Config, QuantizationConfig
    from atom.model_engine.model_runner import ModelRunner
    from atom.models.llama import LlamaForCausalLM
    names = [f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
             "weight_block_size": [128, 128], "ignore": ["lm_head", *names]}
    hf = transformers.AutoConfig.from_pretrained(tiny_llama)
    hf.quantization_config = quant
    with pytest.raises(NotImplementedError, match=r"layer 'model.layers.0.self_attn.qkv_proj' asks for quant_type"):
        LlamaForCausalLM(hf, QuantizationConfig(hf))
    config = Config(model=tiny_llama, num_kvcache_blocks=8, enable_log_stats=False)
    config.quant_config = QuantizationConfig(hf)
    runner = ModelRunner(config)
    from atom.model_ops.quant import describe_layers
    assert {r["method"] for r in describe_layers(runner.model)} == {"unquantized"}


def test_kv_cache_manager_allocates_two_specs_at_once():
    """Full-attention layers and latent (MLA-style) layers in one budget: one block costs
    every layer's page, each group is one allocation, each layer gets its own view, and the
    guide's KVCacheConfig lists what was allocated."""
    from types import SimpleNamespace
    from atom.model_engine.kv_cache import FullAttentionSpec, KVCacheManager, LatentAttentionSpec
    full = FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32)
    latent = LatentAttentionSpec(latent_dim=24, dtype=torch.bfloat16)
    layers = {i: SimpleNamespace(layer_idx=i) for i in range(4)}
    m = KVCacheManager({0: (layers[0], full), 1: (layers[1], latent), 2: (layers[2], full), 3: (layers[3], latent)},
                       block_size=16)
    per_block = 2 * (2 * 16 * 2 * 8 * 4) + 2 * (16 * 24 * 2)
    assert m.bytes_per_block == per_block
    n = m.num_blocks_for(10 * per_block + 5)
    assert n == 10
    cfg = m.allocate(n)
    assert len(m.tensors) == 2 and m.nbytes == 10 * per_block
    assert layers[0].k_cache.shape == (10, 16, 2, 8) and layers[2].v_cache.shape == (10, 16, 2, 8)
    assert layers[1].kv_cache.shape == (10, 16, 24) and layers[1].kv_cache.dtype == torch.bfloat16
    layers[0].k_cache.fill_(1.0)
    layers[3].kv_cache.fill_(2.0)
    assert layers[2].k_cache.abs().sum() == 0 and layers[0].v_cache.abs().sum() == 0
    assert layers[1].kv_cache.abs().sum() == 0
    assert [t.layer_num for t in cfg] == [0, 1, 2, 3] and cfg.nbytes == m.nbytes
    assert cfg.get(1).v_cache is None and cfg.get(0).v_cache is layers[0].v_cache
    df = m.to_frame()
    assert list(df["kind"]) == ["full", "latent", "full", "latent"]
    assert "2xfull, 2xlatent" in repr(m)
    m.release()
    assert layers[0].k_cache.numel() == 0 and m.nbytes == 0
    with pytest.raises(RuntimeError, match="not allocated"):
        m.kv_cache_config()


def test_the_engine_allocates_through_the_manager(tiny_qwen3):
    llm = LLM(tiny_qwen3, enable_log_stats=False, num_kvcache_blocks=24)
    runner = llm.engine.runner
    cfg = runner.kv_cache_config
    assert len(cfg) == len(runner.attn_layers) == 2
    a = runner.attn_layers[1]
    assert cfg.get(1).k_cache is a.k_cache and a.k_cache.shape == (24, 16, a.num_kv_heads, a.head_dim)
    assert runner.kv_bytes_per_block * 24 == cfg.nbytes


def test_compiled_code_does_not_guard_on_the_plan():
    """Level 3 compiles at start-up, before the start-up choices fill the plan: what the
    layers ask the plan under torch.compile must not become a guard of the graph, or the
    first request recompiles it. The plan's tables change after a first compiled call; a
    second call must not recompile."""
    import torch._dynamo
    from atom.model_ops.quant import dense
    from atom.tuning.plan import KernelPlan
    plan, w = KernelPlan(backend="triton"), torch.randn(8, 4)

    def f(x):
        cfg, lt = plan.one_row_config(x, w, "plain"), plan.lt_product(x, w)
        return dense(x, w, plan=plan) + (1.0 if cfg is None and lt is None else 2.0)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    x = torch.randn(1, 4)
    first = compiled(x)
    plan.gemv[(8, 4, torch.float32, "plain")] = {}
    plan.lt[(1, 8, 4, torch.float32)] = (None, None)
    # (the config's own patch: a monkeypatch of it is undone as a delete, which leaves
    # dynamo without the setting for the rest of the process)
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(x), first)  # the torch product, nothing of the plan
    torch._dynamo.reset()


def test_dummy_prefills_for_profiling_and_warm_up(tiny_qwen3):
    """The dummy prefills the GPU start-up profiles and compiles on: consecutive blocks from
    block 0, one forward over all of them."""
    llm = LLM(tiny_qwen3, enable_log_stats=False, num_kvcache_blocks=8)
    runner = llm.engine.runner
    seqs, num_blocks = runner.dummy_prefills([40, 20])
    assert num_blocks == 5 and [s.block_table for s in seqs] == [[0, 1, 2], [3, 4]]
    with torch.inference_mode():
        hidden, meta = runner.dummy_forward(seqs)
    assert hidden.shape == (60, llm.config.hf_config.hidden_size) and meta.cu_seqlens_q.tolist() == [0, 40, 60]
