"""MoE models on a GPU (Triton experts, routing and attention kernels, the fused decoder-layer
forward, CUDA graphs; DeepSeek's MLA kernels and its shared experts on the second stream)
against transformers, fp32. Skipped without a GPU; run on the lent H200."""
import pytest
import torch
import transformers

from atom import LLM, SamplingParams
from conftest import hf_greedy, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def engine_and_reference(path: str, prompt_lens, eager: bool):
    """transformers' greedy tokens (fp32, GPU) for random prompts, then the engine on the same folder."""
    ps = random_prompts(prompt_lens, seed=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ref = [hf_greedy(hf, p, 16) for p in ps]
    del hf
    llm = LLM(path, enable_log_stats=False, max_model_len=1024, max_num_seqs=8, num_kvcache_blocks=128,
              enforce_eager=eager)
    return llm, ps, ref


def check_tokens(llm, ps, ref, eager: bool) -> None:
    assert [o.token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == ref
    if not eager:
        assert sum(llm.engine.runner.graphs.replays.values()) > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("eager", [True, False])
def test_moe_models_on_gpu_equal_transformers(arch, eager, tmp_path):
    from tiny_moe import make_tiny_moe
    llm, ps, ref = engine_and_reference(make_tiny_moe(tmp_path / arch, arch), (1, 9, 70, 300), eager)
    layers = llm.engine.runner.model.model.layers
    assert all("forward" in layer.__dict__ for layer in layers)  # the fused decoder-layer forward
    check_tokens(llm, ps, ref, eager)


@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
@pytest.mark.parametrize("eager", [True, False])
def test_deepseek_on_gpu_equals_transformers(variant, eager, tmp_path):
    from tiny_deepseek import make_tiny_deepseek
    from atom.model_ops.moe import describe_moe_layers
    llm, ps, ref = engine_and_reference(make_tiny_deepseek(tmp_path / variant, variant), (1, 9, 70, 200), eager)
    assert {r["shared_stream"] for r in describe_moe_layers(llm.engine.runner.model)} == {"second"}
    check_tokens(llm, ps, ref, eager)
