"""The engine with the Triton attention op (under Triton's interpreter on CPU, natively on
a GPU) gives transformers' greedy tokens: the GPU glue is exercised in CI."""
import pytest
import torch
import transformers

from atom import LLM, SamplingParams
from conftest import hf_greedy

triton = pytest.importorskip("triton")


def _on_triton(runner, fused: bool = False):
    """The engine's attention on the Triton backend (the interpreter runs it on the CPU);
    with `fused`, also the plan a GPU start-up installs: every kernel, every fusion."""
    from atom.model_ops.attention.triton_backend import TritonAttentionBackend
    from atom.tuning.fusions import default_fusions
    from atom.tuning.plan import KernelPlan
    runner.set_attention_backend(TritonAttentionBackend(runner.attn_layers, 64, runner.device))
    if fused:
        runner.install_plan(KernelPlan(backend="triton", fusions=default_fusions("triton"), force_kernels=True))
    return runner.plan


def spy_attention(monkeypatch) -> list:
    """(max_query_len, rope) of every call of the unified attention op from here on."""
    from atom.model_ops.attention import triton_backend
    calls = []
    real = triton_backend.unified_attention
    monkeypatch.setattr(triton_backend, "unified_attention",
                        lambda *a, **kw: calls.append((a[8], kw["rope"])) or real(*a, **kw))
    return calls


def test_triton_attention_op_in_the_engine(tiny_qwen3):
    llm = LLM(tiny_qwen3, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32)
    _on_triton(llm.engine.runner)
    ps = [[5, 6, 7, 8, 9], list(range(10, 50))]  # the second is chunked: 32 + 8 tokens
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 5) for p in ps]


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_llama"])
def test_all_triton_kernels_in_the_engine(model, request, monkeypatch):
    """Every layer on its Triton kernel, as on a GPU: fused add+norm, SiLU-mul, and for
    prefills the rotary kernel that also writes k and v into the paged cache (the attention op
    then only reads); decode steps fold the rotary embedding and the cache write (after the
    q / k norms: Qwen3) into the attention kernel."""
    from atom.model_ops import kernel_backend, kernels
    path = request.getfixturevalue(model)
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32)
    runner = llm.engine.runner
    _on_triton(runner, fused=True)
    monkeypatch.setattr(kernel_backend, "get", lambda x: kernels)  # the sampler too
    calls = []
    real = kernels.rotary_embedding
    monkeypatch.setattr(kernels, "rotary_embedding",
                        lambda *a, **kw: calls.append(kw.get("kv_cache") is not None) or real(*a, **kw))
    attn_calls = spy_attention(monkeypatch)
    ps = [[5, 6, 7, 8, 9], list(range(10, 50))]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert calls and all(calls), "the rotary kernel did not write the KV cache"
    assert {max_q == 1 for max_q, _ in attn_calls} == {True, False}
    assert all((rope is not None) == (max_q == 1) for max_q, rope in attn_calls), "decode steps fold the rotary in"
    qk_norm = runner.model.model.layers[0].self_attn.qk_norm
    assert all((r.q_norm_weight is not None) == qk_norm for _, r in attn_calls if r is not None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in ps]


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_llama"])
def test_one_row_gemv_paths_in_the_engine(model, request, monkeypatch):
    """Batch-1 decode with every one-row product forced onto the Triton GEMV, as a start-up
    choice may set it on a GPU: the fused norm and SiLU GEMVs, and on Llama (no q/k norm) the
    GEMV that also rotates q/k and writes the KV cache; the tokens stay transformers'."""
    from atom.model_ops import kernel_backend, kernels
    from atom.model_ops.kernels import gemv_rope
    from atom.tuning.gemv_choice import one_row_variants
    path = request.getfixturevalue(model)
    # eager: on a GPU a captured batch-1 graph would replay the kernels chosen at start-up
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32, enforce_eager=True)
    runner = llm.engine.runner
    plan = _on_triton(runner, fused=True)
    monkeypatch.setattr(kernel_backend, "get", lambda x: kernels)
    for m in runner.model.modules():  # the GEMV for every one-row product, as a start-up may choose
        for variant in one_row_variants(m):
            plan.gemv[(m.weight.shape[0], m.weight.shape[1], m.weight.dtype, variant)] = {}
    calls = []
    real = gemv_rope.gemv_norm_rope
    monkeypatch.setattr(gemv_rope, "gemv_norm_rope", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    p = [5, 6, 7, 8, 9]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert bool(calls) == (model == "tiny_llama")  # Qwen3's q/k norm keeps the rotary kernel
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert out[0].token_ids == hf_greedy(hf, p, 4)


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_llama"])
def test_compiled_decoder_layers_run_the_plan_kernels(model, request, monkeypatch):
    """Level 3's compiled graph (here traced through AOT autograd's functionalization, as
    Inductor traces it, without generating code): each decoder layer's norms, SiLU-and-mul
    and its rotary with the cache write are the engine's kernels as registered ops, not torch
    code for Inductor, and the tokens stay transformers'."""
    from atom.model_ops.attention import triton_backend
    from atom.model_ops.kernels import graph_ops
    path = request.getfixturevalue(model)
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32)
    runner = llm.engine.runner
    _on_triton(runner, fused=True)
    torch._dynamo.reset()
    runner.model_forward = torch.compile(runner.model, backend="aot_eager", dynamic=True, fullgraph=True)
    rope_calls, norm_calls = [], []
    real_rope, real_norm = triton_backend.rotary_embedding, graph_ops._fused_add_rms_norm
    monkeypatch.setattr(triton_backend, "rotary_embedding",
                        lambda *a, **kw: rope_calls.append(kw["kv_cache"] is not None) or real_rope(*a, **kw))
    monkeypatch.setattr(graph_ops, "_fused_add_rms_norm", lambda *a: norm_calls.append(1) or real_norm(*a))
    ps = [[5, 6, 7, 8, 9], list(range(10, 50))]  # the second is chunked: 32 + 8 tokens
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    layers = len(runner.model.model.layers)
    steps = runner.num_steps
    assert len(rope_calls) == layers * steps and all(rope_calls), "every layer's rotary wrote the cache in the op"
    assert len(norm_calls) == (2 * layers - 1) * steps  # layer 0's input norm has no residual to add
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in ps]
    torch._dynamo.reset()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_decoder_layers_of_moe_models(arch, tmp_path, monkeypatch):
    """MoE decoder layers take the fused forward too (attention as in the dense models: the
    rotary and the cache write inside the attention kernel on decodes; the MoE block after the
    norm), dense layers beside them (Qwen3-MoE's `mlp_only_layers`): transformers' tokens."""
    from atom.model_ops import kernel_backend, kernels
    from tiny_moe import make_tiny_moe
    path = make_tiny_moe(tmp_path / arch, arch)
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32)
    runner = llm.engine.runner
    _on_triton(runner, fused=True)
    layers = runner.model.model.layers
    assert all("forward" in layer.__dict__ for layer in layers)  # every layer took fused_forward
    assert any(hasattr(layer.mlp, "experts") for layer in layers)
    monkeypatch.setattr(kernel_backend, "get", lambda x: kernels)
    attn_calls = spy_attention(monkeypatch)
    ps = [[5, 6, 7, 8, 9], list(range(10, 50))]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert any(rope is not None for max_q, rope in attn_calls if max_q == 1), "decode steps fold the rotary in"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in ps]
