"""Checkpoints written by the real producers (llm-compressor / compressed-tensors 0.19, AMD
Quark 0.13; `tests/producers/make_checkpoints.py` in the producers' venv, see
tests/quant_producers.py) load in ATOM and generate the greedy tokens transformers gives
when it reloads the same checkpoint in fp32, with the same log-probabilities.

Tolerance on the log-probabilities: both sides dequantize the weights exactly in fp32 and
fake-quantize the activations with the same formulas, so what differs is fp32 summation
order (~1e-6 relative) and, rarely, an activation that lands within an ulp of a rounding
boundary of its fp8/int8/fp4 grid and rounds the other way; one such flip moves a logit
by about one quantization step times a weight (~1e-3 on these models, |logit| <= 14).
5e-3 is above that and far below what a wrong layout gives (`test_wrong_layout_is_caught`).

The log-probs are compared on one prefill of prompt + greedy tokens, which is what the
reference computes (a full forward): there they agree to ~1e-5 on every scheme. Decode steps
multiply one row at a time (another fp32 summation order), and on the int8 W8A8 checkpoint a
rounding flip of one int8 activation then moves later log-probs by up to ~0.05 on this
random model (measured: prefill 0.0, decode steps 5-7 of the 40-token prompt 0.01-0.05)
while the greedy tokens stay equal; the tokens are checked on the decode path.
"""
from __future__ import annotations

import os

import pytest

from quant_producers import make_checkpoints, producer_python, reference

#: scheme -> the format every quantized layer shows in linear_methods_frame
SCHEMES = {
    "ct_fp8_dynamic": "fp8 per-channel, act dynamic per-token",
    "ct_fp8_block32": "fp8 block 32x32, act dynamic 1x32",
    "ct_fp8_block": "fp8 block 128x128, act dynamic 1x128",  # llm-compressor's FP8_BLOCK preset
    "ct_w4a16": "int4 g128 sym",  # its W4A16 preset
    "ct_fp8_static": "fp8 per-tensor, act static per-tensor",
    "ct_w8a8": "int8 per-channel, act dynamic per-token",
    "ct_w4a16_g32": "int4 g32 sym",
    "ct_w4a16_g64_asym": "int4 g64 asym",
    "ct_mxfp4a16": "mxfp4 1x32 e8m0, weight only",
    "ct_mxfp4": "mxfp4 1x32 e8m0, act dynamic mxfp4 1x32",
    "quark_ptpc_fp8": "fp8 per-channel, act dynamic per-token",
    "quark_fp8": "fp8 per-tensor, act static per-tensor",
    "quark_int4_wo_32": "int4 g32 sym",
    "quark_int4_wo_64": "int4 g64 sym",
    "quark_mxfp4": "mxfp4 1x32 e8m0, act dynamic mxfp4 1x32",
    "quark_mxfp4_weight_only": "mxfp4 1x32 e8m0, weight only",
}
LOGPROB_TOL = 5e-3


@pytest.fixture(scope="session")
def producer_checkpoints():
    if producer_python() is None:
        pytest.skip("the producers' venv (.venv-prod, or $ATOM_PRODUCER_PYTHON) is absent: `make producers` "
                    "installs llm-compressor, compressed-tensors and amd-quark into it")
    return make_checkpoints(list(SCHEMES))


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_producer_checkpoint_generates_like_transformers(producer_checkpoints, scheme):
    from atom import LLM, SamplingParams
    from atom.viz import linear_methods_frame
    folder = producer_checkpoints / scheme
    ref = reference(folder)
    llm = LLM(str(folder), dtype="float32", enable_log_stats=False, num_kvcache_blocks=64)
    sp = SamplingParams(temperature=0, max_tokens=len(ref["greedy"][0]), ignore_eos=True)
    outs = llm.generate(ref["prompts"], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref["greedy"]
    # log-probs of the same tokens from one prefill of prompt + greedy tokens (the reference
    # is a full forward too; see the module docstring for why not the decode steps')
    full = [p + g for p, g in zip(ref["prompts"], ref["greedy"])]
    outs = llm.generate(full, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for o, p, g, want in zip(outs, ref["prompts"], ref["greedy"], ref["logprobs"]):
        got = [o.prompt_logprobs[len(p) + i][t].logprob for i, t in enumerate(g)]
        assert got == pytest.approx(want, abs=LOGPROB_TOL)
    frame = linear_methods_frame(llm)
    quantized = frame[frame["method"] != "unquantized"]
    assert len(quantized) == 8  # qkv, o, gate_up, down in each of the 2 layers; lm_head excluded
    assert set(quantized["format"]) == {SCHEMES[scheme]}
    for _, row in quantized.iterrows():  # stored quantized: well under the fp32 model's bytes
        dense = row["shape"][0] * row["shape"][1] * 4
        assert row["bytes"] < (0.2 if "4" in SCHEMES[scheme].split()[0] else 0.35) * dense, row.to_dict()


@pytest.fixture(scope="session")
def smollm2_fp8_checkpoint(smollm2_path):
    if os.environ.get("ATOM_SMOLLM2_PRODUCER") != "1":
        pytest.skip("SmolLM2 producer checkpoint not requested: making it costs ~80 s of CPU (load 540 MB, "
                    "quantize, save 163 MB, reload); run with ATOM_SMOLLM2_PRODUCER=1 (-m smollm2_producer)")
    if producer_python() is None:
        pytest.skip("the producers' venv (.venv-prod, or $ATOM_PRODUCER_PYTHON) is absent: `make producers`")
    return make_checkpoints(["smollm2_ct_fp8_dynamic"], env={"ATOM_SMOLLM2_BASE": str(smollm2_path)})


@pytest.mark.slow
@pytest.mark.smollm2_producer
def test_smollm2_fp8_dynamic_generates_like_transformers(smollm2_fp8_checkpoint):
    """llm-compressor FP8_DYNAMIC of the embedded SmolLM2 (163 MB, made once and cached)."""
    from atom import LLM, SamplingParams
    from atom.viz import linear_methods_frame
    folder = smollm2_fp8_checkpoint / "smollm2_ct_fp8_dynamic"
    ref = reference(folder)
    llm = LLM(str(folder), dtype="float32", enable_log_stats=False, num_kvcache_blocks=64)
    outs = llm.generate(ref["prompts"], SamplingParams(temperature=0, max_tokens=len(ref["greedy"][0]),
                                                       ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref["greedy"]
    # 30 layers of per-token fp8 rounding amplify fp32 summation-order differences (1e-7)
    # into log-prob changes: measured 0.03 (MKL with 1 vs 2 threads, one prompt) to 0.2 (the
    # three prompts in one batch, whose row count changes MKL's blocking) against the same
    # engine, so the bound here is 0.3; the greedy tokens above are the exact check
    full = [p + g for p, g in zip(ref["prompts"], ref["greedy"])]
    outs = llm.generate(full, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for o, p, g, want in zip(outs, ref["prompts"], ref["greedy"], ref["logprobs"]):
        got = [o.prompt_logprobs[len(p) + i][t].logprob for i, t in enumerate(g)]
        assert got == pytest.approx(want, abs=0.3)
    frame = linear_methods_frame(llm)
    quantized = frame[frame["method"] != "unquantized"]
    assert len(quantized) == 4 * 30 and set(quantized["format"]) == {SCHEMES["ct_fp8_dynamic"]}
