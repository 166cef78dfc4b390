"""The engine on a GPU (Triton kernels, CUDA graphs, compilation levels) against
transformers and against eager. Skipped without a GPU; run on the lent H200."""
import pytest
import torch
import transformers

from atom import LLM, SamplingParams
from conftest import TINY, hf_greedy

pytestmark = pytest.mark.gpu

SHAPES = {
    "qwen3": dict(arch="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128),
    "llama": dict(arch="llama3", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4),
}


def make(path, spec):
    from conftest import make_tiny_model
    spec = dict(spec)
    arch = spec.pop("arch")
    return make_tiny_model(path, arch, **{**TINY, "vocab_size": 1024, "max_position_embeddings": 4096, **spec})


@pytest.fixture(scope="module", params=list(SHAPES))
def model_path(request, tmp_path_factory):
    return make(tmp_path_factory.mktemp(request.param), SHAPES[request.param])


def prompts(lens=(1, 7, 33, 130, 600), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1024, (n,), generator=g).tolist() for n in lens]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_ref(model_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda().eval()
    ps = prompts()
    out = []
    for p in ps:
        ids = hf_greedy(hf, p, 24)
        out.append(ids)
    del hf
    torch.cuda.empty_cache()
    return ps, out


SETTINGS = {
    "eager": dict(enforce_eager=True),
    "graphs": dict(),
    "chunked+prefix": dict(enforce_eager=True, max_num_batched_tokens=64, enable_prefix_caching=True),
    "preemption_graphs": dict(num_kvcache_blocks=28, kv_cache_block_size=32),
    "block64": dict(kv_cache_block_size=64),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fp32_greedy_equals_transformers(model_path, hf_ref, setting):
    ps, ref = hf_ref
    llm = LLM(model_path, enable_log_stats=False, max_model_len=2048, max_num_seqs=16,
              **{"num_kvcache_blocks": 256, **SETTINGS[setting]})
    assert llm.engine.runner.attn_layers[0].backend.name == "triton"
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    if setting == "graphs":
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
    if setting == "preemption_graphs":
        assert llm.stats.steps()["preemptions"].sum() > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("eager", [True, False])
def test_fp32_greedy_with_the_triton_gemm(model_path, hf_ref, eager, monkeypatch):
    """ATOM_USE_TRITON_GEMM=1: the linear layers' products (but the batch-1 GEMV ones) on the
    Triton GEMM, eager and in CUDA graphs; the same tokens as transformers. fp32 takes the
    GEMM's pointer-load path; its bf16 TMA path is checked against F.linear in test_gemm.py."""
    import atom.model_ops.kernels.gemm as gemm_mod
    calls = []
    real = gemm_mod.gemm
    monkeypatch.setattr(gemm_mod, "gemm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setenv("ATOM_USE_TRITON_GEMM", "1")
    ps, ref = hf_ref
    llm = LLM(model_path, enable_log_stats=False, max_model_len=2048, max_num_seqs=16, num_kvcache_blocks=256,
              enforce_eager=eager)
    assert llm.engine.runner.plan.triton_gemm
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert calls and max(calls) > 1  # prefill products went through it


MODES = ["NONE", "TR_HYBRID", "FULL", "FULL_DECODE_ONLY", "FULL_AND_TR_HYBRID"]
# level 0: every graph mode; compiled levels: the guide's default mode (TR_HYBRID at 3)
LEVEL_MODES = [(0, m) for m in MODES] + [(1, "FULL_DECODE_ONLY"), (2, "FULL_DECODE_ONLY"),
                                         (3, "TR_HYBRID"), (3, "FULL")]


@pytest.mark.parametrize("level,mode", LEVEL_MODES)
def test_levels_and_graph_modes_match_transformers(model_path, hf_ref, level, mode):
    if level > 0 and "qwen3" not in model_path:
        pytest.skip("compiled levels are checked on the Qwen3 model (compile time)")
    ps, ref = hf_ref
    # 256-token steps: the 600-token prompt is chunked, chunks run beside decodes
    llm = LLM(model_path, enable_log_stats=False, max_model_len=2048, num_kvcache_blocks=256,
              max_num_seqs=16, max_num_batched_tokens=256, compilation_config={"level": level, "cudagraph_mode": mode,
                                                   "cudagraph_capture_sizes": [1, 2, 4, 8]})
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref, f"level {level} mode {mode}"
    graphs, mixed = llm.engine.runner.graphs, llm.engine.runner.mixed_graphs
    assert (graphs is None) == (mode == "NONE")
    # steps with prefill tokens replay a token-bucket graph where the mode's mixed half records graphs
    assert (mixed is not None) == (mode in ("TR_HYBRID", "FULL", "FULL_AND_TR_HYBRID")), mode
    if mixed is not None:
        assert sum(mixed.replays.values()) > 0, mixed


def bf16_agreement(model_path, lens=(5, 40, 300, 800), new_tokens=64) -> dict:
    """Teacher-forced top-1 agreement of ATOM (bf16) with transformers (bf16) on ATOM's own
    greedy continuation; also transformers bf16 against transformers fp32 (the noise floor)."""
    import json, os, shutil, tempfile
    tmp = tempfile.mkdtemp()
    for f in os.listdir(model_path):
        shutil.copy(os.path.join(model_path, f), tmp)
    cfg = json.load(open(os.path.join(tmp, "config.json")))
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"))
    llm = LLM(tmp, enable_log_stats=False, max_model_len=2048, num_kvcache_blocks=256)
    assert llm.engine.runner.dtype == torch.bfloat16
    ps = prompts(lens=lens, seed=3)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    del llm
    counts = {"atom_vs_hf_bf16": 0, "hf_bf16_vs_hf_fp32": 0, "total": 0, "decisive_agree": 0, "decisive": 0}
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).cuda().eval()
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda().eval()
    for p, o in zip(ps, outs):
        seq = torch.tensor([p + o.token_ids], device="cuda")
        with torch.inference_mode():
            p16 = hf16(seq).logits[0, len(p) - 1:-1].argmax(-1)
            l32 = hf32(seq).logits[0, len(p) - 1:-1].float()
        p32 = l32.argmax(-1)
        # decisive positions: fp32 top-2 gap above bf16's rounding of the logits (1% of |max|)
        top2 = l32.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 0.01 * l32.abs().amax(-1)
        ours = torch.tensor(o.token_ids, device="cuda")
        counts["decisive"] += int(decisive.sum())
        counts["decisive_agree"] += int(((p16 == ours) & decisive).sum())
        counts["atom_vs_hf_bf16"] += int((p16 == ours).sum())
        counts["hf_bf16_vs_hf_fp32"] += int((p16 == p32).sum())
        counts["total"] += len(o.token_ids)
    return {"atom_vs_hf_bf16": counts["atom_vs_hf_bf16"] / counts["total"],
            "hf_bf16_vs_hf_fp32": counts["hf_bf16_vs_hf_fp32"] / counts["total"],
            "decisive_fraction": counts["decisive"] / counts["total"],
            "atom_vs_hf_bf16_decisive": counts["decisive_agree"] / max(counts["decisive"], 1)}


@pytest.fixture(scope="module", params=list(SHAPES))
def bf16_model_path(request, tmp_path_factory):
    # a milder init than the fp32 tests: random weights at 0.45 give bf16 near-ties
    return make(tmp_path_factory.mktemp(f"bf16_{request.param}"), {**SHAPES[request.param],
                                                                   "initializer_range": 0.1})


def test_bf16_teacher_forced_top1_agreement(bf16_model_path):
    agree = bf16_agreement(bf16_model_path)
    print("bf16 agreement", agree)
    # random weights have near-ties that bf16 rounding flips in transformers itself
    # (hf_bf16_vs_hf_fp32 is ~96% here): >= 99% is required where the reference is decisive,
    # and the raw figure must be within 2 points of transformers' own bf16/fp32 floor.
    assert agree["decisive_fraction"] >= 0.5, agree
    assert agree["atom_vs_hf_bf16_decisive"] >= 0.99, agree
    assert agree["atom_vs_hf_bf16"] >= agree["hf_bf16_vs_hf_fp32"] - 0.02, agree
