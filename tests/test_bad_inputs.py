"""Bad requests fail alone with a clear error; the rest of the batch completes and every
KV block is freed. Bad engine configuration fails before any weight loads."""
import pytest

from atom import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=64, max_model_len=256)


GOOD = [5, 6, 7, 8]
SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def check_isolated(llm, bad_prompt, bad_sp, match):
    outs = llm.generate([GOOD, bad_prompt, GOOD], [SP, bad_sp, SP], use_tqdm=False)
    assert outs[1].finish_reason == "error" and match in outs[1].error
    assert outs[0].num_output_tokens == 4 and outs[2].num_output_tokens == 4
    assert outs[0].token_ids == outs[2].token_ids
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and llm.engine.is_finished()


def test_empty_prompt(llm):
    check_isolated(llm, [], SP, "empty")


def test_too_long_prompt(llm):
    check_isolated(llm, list(range(3, 303)), SP, "max_model_len=256")


def test_token_ids_out_of_vocab(llm):
    check_isolated(llm, [1, 99999], SP, "[0, 512)")


def test_text_prompt_without_tokenizer(llm):
    check_isolated(llm, "hello", SP, "no tokenizer")


def test_sampling_params_broken_after_construction(llm):
    sp = SamplingParams(temperature=0, max_tokens=4)
    sp.max_tokens = 0
    check_isolated(llm, GOOD, sp, "max_tokens")


def test_bad_sampling_params_are_refused_at_construction():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_engine_add_request_raises_directly(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.engine.add_request([])
    assert llm.engine.is_finished()


def test_mismatched_sampling_params_list(llm):
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        llm.generate([GOOD] * 3, [SP, SP], use_tqdm=False)


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "nowhere"))


def test_unsupported_architecture(tmp_path):
    import transformers
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                            architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        LLM(str(tmp_path))


def test_unknown_keyword_is_a_type_error(tiny_llama):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(tiny_llama, max_num_seq=4)


def test_bad_config_fails_before_weights_load(tiny_llama, monkeypatch):
    import atom.model_loader.loader as loader
    monkeypatch.setattr(loader, "load_weights", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match="kv_cache_block_size"):
        LLM(tiny_llama, kv_cache_block_size=24)


def test_abort_frees_blocks(llm):
    rid = llm.engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
    llm.engine.step()
    assert llm.engine.block_manager.num_free_blocks < llm.engine.block_manager.num_blocks
    out = llm.engine.abort(rid)
    assert out.finish_reason == "abort"
    assert llm.engine.is_finished()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
