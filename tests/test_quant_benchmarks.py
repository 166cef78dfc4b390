"""The quantized-format side of the GPU benchmarks, on CPU: the producers' config blocks the
benchmark writes, dummy weights of every quantized format (valid values and scales, sane
logits, xavier-like std), the roofline's weight bytes per format, the CLI's validation and
the vLLM peer's arguments (built without vLLM)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from atom.benchmarks import peer_vllm, roofline, throughput
from atom.benchmarks.quant_formats import FORMATS, VLLM_SM90, get_format
from test_peer_vllm import fake_vllm  # noqa: F401  (the stand-in vllm fixture)

from atom.benchmarks.workloads import (MODEL_CONFIGS, long_context_workload, make_workload, needed_model_len,
                                      write_model_config)

QUANTIZED = [f for f in FORMATS if f != "bf16"]

# the FP8_DYNAMIC block llm-compressor 0.14 / compressed-tensors 0.19 wrote (shared/QUANT_PRODUCERS.md)
CT_FP8_DYNAMIC = json.loads(
    '{"config_groups":{"group_0":{"format":"float-quantized","input_activations":{"actorder":null,'
    '"block_structure":null,"dynamic":true,"group_size":null,"num_bits":8,"observer":null,"observer_kwargs":{},'
    '"scale_dtype":null,"strategy":"token","symmetric":true,"type":"float","zp_dtype":null},'
    '"output_activations":null,"targets":["Linear"],"weights":{"actorder":null,"block_structure":null,'
    '"dynamic":false,"group_size":null,"num_bits":8,"observer":"memoryless_minmax","observer_kwargs":{},'
    '"scale_dtype":null,"strategy":"channel","symmetric":true,"type":"float","zp_dtype":null}}},'
    '"format":"float-quantized","global_compression_ratio":null,"ignore":["lm_head"],"kv_cache_scheme":null,'
    '"quant_method":"compressed-tensors","quantization_status":"compressed","sparsity_config":{},'
    '"transform_config":{},"version":"0.19.0"}')

# what ATOM's methods report for each format's linears
ATOM_FORMAT = {"fp8_dynamic": "fp8 per-channel, act dynamic per-token",
               "fp8_block": "fp8 block 128x128, act dynamic 1x128",
               "w8a8_int8": "int8 per-channel, act dynamic per-token",
               "w4a16": "int4 g128 sym", "mxfp4_w4a16": "mxfp4 1x32 e8m0, weight only"}


# --- config blocks ------------------------------------------------------------------------
def test_fp8_dynamic_block_is_the_producers_own():
    assert FORMATS["fp8_dynamic"].quantization_config() == CT_FP8_DYNAMIC


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_config_folder_holds_the_format_block(tmp_path, fmt):
    folder = write_model_config("llama-3.1-8b", folder=str(tmp_path), quantization=fmt)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    block = cfg["quantization_config"]
    assert block == FORMATS[fmt].quantization_config()
    assert block["quant_method"] == "compressed-tensors" and block["ignore"] == ["lm_head"]
    group = block["config_groups"]["group_0"]
    w, a = group["weights"], group["input_activations"]
    expect = {"fp8_dynamic": ("float-quantized", 8, "float", "channel", None, "token"),
              "fp8_block": ("float-quantized", 8, "float", "block", None, "group"),
              "w8a8_int8": ("int-quantized", 8, "int", "channel", None, "token"),
              "w4a16": ("pack-quantized", 4, "int", "group", 128, None),
              "mxfp4_w4a16": ("mxfp4-pack-quantized", 4, "float", "group", 32, None)}[fmt]
    got = (group["format"], w["num_bits"], w["type"], w["strategy"], w["group_size"], a and a["strategy"])
    assert got == expect
    if fmt == "fp8_block":
        assert w["block_structure"] == [128, 128] and a["group_size"] == 128 and a["dynamic"] is True
    if fmt == "mxfp4_w4a16":
        assert w["scale_dtype"] == "torch.uint8"
    # the bf16 shape is untouched
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == MODEL_CONFIGS["llama-3.1-8b"]


def test_bf16_folder_has_no_block_and_formats_get_their_own_folder():
    plain = write_model_config("qwen3-0.6b")
    assert "quantization_config" not in json.load(open(os.path.join(plain, "config.json")))
    assert write_model_config("qwen3-0.6b", quantization="w4a16") != plain


def test_unknown_format_is_refused_naming_the_allowed_ones(capsys):
    with pytest.raises(ValueError, match="nvfp4.*fp8_dynamic, fp8_block, w8a8_int8, w4a16, mxfp4_w4a16"):
        get_format("nvfp4")
    with pytest.raises(SystemExit):
        throughput.main(["--device", "cuda", "--quantization", "nvfp4"])
    err = capsys.readouterr().err
    assert "--quantization" in err and "'nvfp4' is unknown" in err and "mxfp4_w4a16" in err
    with pytest.raises(ValueError, match="model='gpt-oss-20b-mxfp4' already holds"):
        write_model_config("gpt-oss-20b-mxfp4", quantization="fp8_dynamic")


def test_settings_that_cannot_run_are_refused_before_anything_is_built():
    with pytest.raises(SystemExit, match="CPU run measures the embedded bf16 model only"):
        throughput.main(["--device", "cpu", "--quantization", "fp8_dynamic"])
    with pytest.raises(SystemExit, match="--peer hf runs the bf16 model"):
        throughput.main(["--device", "cuda", "--peer", "hf", "--kv-cache-dtype", "fp8"])
    with pytest.raises(SystemExit):
        throughput.main(["--device", "cuda", "--workload", "huge"])


# --- the vLLM peer's arguments --------------------------------------------------------------
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_vllm_peer_arguments_for_each_format(tmp_path, fmt, kv):
    ap = throughput.argparse.ArgumentParser()
    peer_vllm.add_engine_limit_args(ap)
    peer_vllm.add_format_args(ap)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.6)
    bench_args = ap.parse_args(["--quantization", fmt, "--kv-cache-dtype", kv, "--max-model-len", "9000"])
    cmd = peer_vllm.child_command("throughput", str(tmp_path), 128256, bench_args,
                                  ["--num-seqs", "64", "--workload", "long"])
    assert cmd[1:3] == ["-m", "atom.benchmarks.peer_vllm"]
    child = peer_vllm.build_parser().parse_args(cmd[3:])  # what the child process parses
    assert (child.quantization, child.kv_cache_dtype, child.workload, child.num_seqs) == (fmt, kv, "long", 64)
    kw = peer_vllm.engine_kwargs(child)
    assert kw["model"] == str(tmp_path) and kw["load_format"] == "dummy" and kw["max_model_len"] == 9000
    assert kw["kv_cache_dtype"] == kv
    assert kw.get("quantization") == (None if fmt == "bf16" else "compressed-tensors")
    assert VLLM_SM90[fmt].kernel


def test_a_format_vllm_cannot_run_is_reported_and_not_tried(monkeypatch):
    from atom.benchmarks import quant_formats
    monkeypatch.setitem(quant_formats.VLLM_SM90, "mxfp4_w4a16", quant_formats.VllmSupport(False, "no kernel"))
    monkeypatch.setattr(peer_vllm, "run_in_child", lambda *a: pytest.fail("must not start vLLM"))
    args = throughput.argparse.Namespace(quantization="mxfp4_w4a16")
    res, note = peer_vllm.peer_result("latency", "/nowhere", 10, args, [])
    assert res is None and note == "vLLM does not run mxfp4_w4a16 on sm90: no kernel"

    def failing(*a):
        raise SystemExit("--peer vllm: the vLLM run failed (exit 1)")
    monkeypatch.setattr(peer_vllm, "run_in_child", failing)
    res, note = peer_vllm.peer_result("latency", "/nowhere", 10, throughput.argparse.Namespace(quantization="w4a16"), [])
    assert res is None and note.startswith("vLLM failed on w4a16") and "exit 1" in note


# --- workloads ----------------------------------------------------------------------------
def test_long_workload():
    reqs = make_workload("long")
    assert len(reqs) == 64
    assert all(4096 <= len(r.prompt_token_ids) <= 8192 and 100 <= r.max_tokens <= 512 for r in reqs)
    assert needed_model_len(reqs) == max(len(r.prompt_token_ids) + r.max_tokens for r in reqs) <= 8704
    assert [r.prompt_token_ids for r in long_context_workload(3)] == [r.prompt_token_ids for r in make_workload("long", 3)]
    assert len(make_workload("nano-vllm")) == 256
    with pytest.raises(ValueError, match="--workload='x' is unknown: choose one of nano-vllm, long"):
        make_workload("x")


# --- roofline bytes -----------------------------------------------------------------------
def _llama_linears():
    h, i, L, d = 4096, 14336, 32, 128
    return L, [((32 + 16) * d, h), (h, 32 * d), (2 * i, h), (h, i)]


@pytest.mark.parametrize("fmt, per_param, scale_of", [
    ("fp8_dynamic", 1.0, lambda n, k: 2 * n),
    ("w8a8_int8", 1.0, lambda n, k: 2 * n),
    ("fp8_block", 1.0, lambda n, k: 2 * math.ceil(n / 128) * math.ceil(k / 128)),
    ("w4a16", 0.5, lambda n, k: 2 * n * k // 128),
    ("mxfp4_w4a16", 0.5, lambda n, k: n * k // 32),
])
def test_roofline_counts_the_format_bytes(fmt, per_param, scale_of):
    cfg = MODEL_CONFIGS["llama-3.1-8b"]
    L, lins = _llama_linears()
    embed = 2 * cfg["vocab_size"] * cfg["hidden_size"] * 2  # embeddings and LM head stay bf16
    want = L * sum(n * k * per_param + scale_of(n, k) for n, k in lins) + embed
    c = roofline.model_cost(cfg, weight_format=fmt)
    assert c.step_weight_bytes(1) == pytest.approx(want, rel=1e-9)
    bf16 = roofline.model_cost(cfg)
    assert bf16.step_weight_bytes(1) == bf16.params * 2 == L * sum(n * k for n, k in lins) * 2 + embed
    ratio = roofline.decode_floor_ms(cfg, 1, 0) / roofline.decode_floor_ms(cfg, 1, 0, weight_format=fmt)
    assert ratio == pytest.approx(bf16.step_weight_bytes(1) / want)
    assert (1.7 < ratio < 1.95) if per_param == 1 else (2.6 < ratio < 3.0)


def test_roofline_kv_dtype_and_fp8_peak():
    cfg = MODEL_CONFIGS["llama-3.1-8b"]
    assert roofline.model_cost(cfg, kv_cache_dtype="fp8").kv_bytes_per_token * 2 == \
        roofline.model_cost(cfg).kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    long = long_context_workload(8)
    p, o = [len(r.prompt_token_ids) for r in long], [r.max_tokens for r in long]
    bf16 = roofline.workload_floor(cfg, p, o)
    kv8 = roofline.workload_floor(cfg, p, o, kv_cache_dtype="fp8")
    assert kv8.decode_seconds < bf16.decode_seconds and kv8.prefill_seconds == bf16.prefill_seconds
    fp8 = roofline.workload_floor(cfg, p, o, weight_format="fp8_dynamic")
    w4 = roofline.workload_floor(cfg, p, o, weight_format="w4a16")
    assert fp8.prefill_seconds < bf16.prefill_seconds == w4.prefill_seconds  # fp8 tensor cores: 2x peak
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is unknown"):
        roofline.model_cost(cfg, kv_cache_dtype="int4")
    moe = MODEL_CONFIGS["qwen3-30b-a3b"]
    assert roofline.model_cost(moe, weight_format="fp8_dynamic").step_weight_bytes(64) < \
        0.6 * roofline.model_cost(moe).step_weight_bytes(64)


def test_roofline_cli_names_the_format(tmp_path):
    out = tmp_path / "r.json"
    roofline.main(["--model", "llama-3.1-8b", "--quantization", "w4a16", "--kv-cache-dtype", "fp8", "--out", str(out)])
    res = json.load(open(out))
    assert res["quantization"] == "w4a16" and res["kv_cache_dtype"] == "fp8"
    assert res["decode_floor_ms_b1_640"] == pytest.approx(roofline.decode_floor_ms(
        MODEL_CONFIGS["llama-3.1-8b"], 1, 640, weight_format="w4a16", kv_cache_dtype="fp8"))


# --- dummy weights ------------------------------------------------------------------------
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=384, hidden_size=128,
            intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            max_position_embeddings=512, hidden_act="silu", torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)


def _dummy_llm(tmp_path, cfg: dict):
    from atom import LLM
    os.makedirs(tmp_path, exist_ok=True)
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return LLM(str(tmp_path), load_dummy="xavier", enable_log_stats=False, num_kvcache_blocks=16,
               dtype="bfloat16")


def _logits(llm, prompt: list[int], n: int = 4) -> torch.Tensor:
    from atom import SamplingParams
    model = llm.engine.runner.model
    got = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: got.append(o.detach().float()))
    try:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    finally:
        hook.remove()
    return torch.cat([g.reshape(-1, g.shape[-1]) for g in got])


def _check_logits(logits: torch.Tensor) -> None:
    assert torch.isfinite(logits).all()
    assert float(logits.std(dim=-1).min()) > 1e-3  # not constant over the vocabulary
    assert float((logits[0] - logits[-1]).abs().max()) > 1e-3  # and not the same at every position


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_dummy_quantized_model_is_sane(tmp_path, fmt):
    from atom.model_ops.quant.common import QuantLinearMethod
    from atom.viz import linear_methods_frame
    llm = _dummy_llm(tmp_path, {**TINY, "quantization_config": FORMATS[fmt].quantization_config()})
    frame = linear_methods_frame(llm)
    quantized = frame[frame["method"] != "unquantized"]
    assert len(quantized) == 8 and set(quantized["format"]) == {ATOM_FORMAT[fmt]}  # 2 x (qkv, o, gate_up, down)
    assert frame.set_index("layer").loc["lm_head", "method"] == "unquantized"
    n = 0
    for name, m in llm.engine.runner.model.named_modules():
        if not isinstance(getattr(m, "method", None), QuantLinearMethod):
            continue
        for pname, p in m.named_parameters(recurse=False):
            if "scale" in pname:
                assert (p.float() > 0).all(), (name, pname)
        w = m.method.dequantized_weight(m)
        xavier = (2.0 / (m.in_features + m.out_features)) ** 0.5
        assert torch.isfinite(w).all() and 0.5 < float(w.std()) / xavier < 2.0, (name, float(w.std()), xavier)
        assert abs(float(w.mean())) < 0.1 * xavier
        n += 1
    assert n == 8
    _check_logits(_logits(llm, list(range(3, 20))))


def test_dummy_bf16_model_values_are_unchanged(tmp_path):
    """The bf16 rule is the one it was: xavier normal from one generator, in parameter order."""
    llm = _dummy_llm(tmp_path, TINY)
    model = llm.engine.runner.model
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            assert (p == 1).all()
        elif p.dim() >= 2:
            std = (2.0 / (p.shape[-1] + p.shape[-2])) ** 0.5
            want = (torch.randn(p.shape, generator=gen) * std).to(p.dtype)
            assert torch.equal(p.data, want), name
    _check_logits(_logits(llm, list(range(3, 20))))


def test_dummy_mxfp4_experts_of_gpt_oss_are_random_and_scaled(tmp_path):
    from tiny_gpt_oss import BASE, NOT_CONVERTED
    cfg = dict(BASE, architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=2,
               layer_types=["sliding_attention", "full_attention"], hidden_act="silu", swiglu_limit=7.0,
               attention_bias=True, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, hidden_size=128,
               intermediate_size=64, head_dim=32,
               quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED})
    llm = _dummy_llm(tmp_path, cfg)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.method.name == "mxfp4"
    H, I = 128, 64
    for e in range(experts.num_local_experts):
        w13, w2 = experts.method.dequantized(experts, e)
        for w, (rows, cols) in ((w13, (2 * I, H)), (w2, (H, I))):
            xavier = (2.0 / (rows + cols)) ** 0.5
            assert w.shape == (rows, cols) and 0.5 < float(w.std()) / xavier < 2.0
    assert len(torch.unique(experts.w13_weight)) > 200  # random bytes, not zeros
    _check_logits(_logits(llm, list(range(3, 20))))


def test_dummy_fp8_experts_are_scaled(tmp_path):
    cfg = dict(TINY, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[], rope_theta=1e6)
    from atom.benchmarks.workloads import producer_ignore
    cfg["quantization_config"] = FORMATS["fp8_dynamic"].quantization_config(ignore=producer_ignore(cfg))
    llm = _dummy_llm(tmp_path, cfg)
    mlp = llm.engine.runner.model.model.layers[0].mlp
    assert type(mlp.gate.method).__name__.startswith("Unquantized")  # the router stays in the model's dtype
    experts = mlp.experts
    assert experts.method.name == "fp8"
    assert (experts.w13_weight_scale > 0).all() and (experts.w2_weight_scale > 0).all()
    w13, w2 = experts.method.dequantized(experts, 1)
    for w in (w13, w2):
        xavier = (2.0 / sum(w.shape)) ** 0.5
        assert 0.5 < float(w.std()) / xavier < 2.0
    _check_logits(_logits(llm, list(range(3, 20))))


def test_dummy_rules_for_each_dtype():
    """`dummy_fill` on bare parameters: values in range, scales from the tensor they scale."""
    from torch import nn
    from atom.model_loader.loader import FP4_CODE_STD, INT4_CODE_STD, dummy_fill
    m = nn.Module()
    m.weight_packed = nn.Parameter(torch.zeros(256, 64, dtype=torch.int32), requires_grad=False)  # K = 512
    m.weight_scale = nn.Parameter(torch.zeros(256, 4), requires_grad=False)
    m.weight_zero_point = nn.Parameter(torch.zeros(32, 4, dtype=torch.int32), requires_grad=False)
    m.w2_weight = nn.Parameter(torch.zeros(2, 256, 256, dtype=torch.uint8), requires_grad=False)  # K = 512
    m.w2_weight_scale = nn.Parameter(torch.zeros(2, 256, 16, dtype=torch.uint8), requires_grad=False)
    gen = torch.Generator().manual_seed(0)
    for name, p in m.named_parameters():
        dummy_fill(m, name, p, gen)
    from atom.model_ops.quant.int4 import unpack_int4
    q = unpack_int4(m.weight_packed).int() - 8
    assert q.min() == -7 and q.max() == 7 and abs(float(q.float().mean())) < 0.05
    assert float(q.float().std()) == pytest.approx(INT4_CODE_STD, rel=0.02)
    xavier = (2.0 / (512 + 256)) ** 0.5
    assert torch.allclose(m.weight_scale, torch.tensor(xavier / INT4_CODE_STD))
    assert (unpack_int4(m.weight_zero_point) == 8).all()
    assert int(m.w2_weight_scale[0, 0, 0]) == 127 + round(math.log2(xavier / FP4_CODE_STD))
    with pytest.raises(ValueError, match="no values for the scale 'input_zero_scale'"):
        dummy_fill(m, "input_zero_scale", nn.Parameter(torch.zeros(1)), gen)


def test_quantized_long_workload_runs_in_the_vllm_child(fake_vllm):
    """The child (a stand-in vllm, tests/test_peer_vllm.py) runs a quantized folder on the
    long workload with an FP8 KV cache from the arguments the benchmark builds."""
    args = throughput.argparse.Namespace(temperature=0.6, repeat=1, max_model_len=8704, gpu_memory_utilization=0.9,
                                         max_num_seqs=512, max_num_batched_tokens=16384, enforce_eager=False,
                                         quantization="fp8_block", kv_cache_dtype="fp8")
    path = write_model_config("llama-3.1-8b", quantization="fp8_block")
    res, note = peer_vllm.peer_result("throughput", path, 128256, args, ["--num-seqs", "2", "--workload", "long"])
    assert note == VLLM_SM90["fp8_block"].kernel
    assert res["tokens"] == sum(r.max_tokens for r in long_context_workload(2))


def test_gpu_run_writes_format_kv_dtype_and_the_three_figures(tmp_path, monkeypatch, capsys):
    """`throughput`'s GPU path end to end on a tiny shape on CPU (the GPU, the workload and
    vLLM stood in): the JSON names the format, the KV dtype and the workload, and the table
    has ATOM, vLLM and the roofline side by side."""
    from atom.benchmarks import workloads
    from atom.benchmarks.workloads import mixed_workload
    monkeypatch.setitem(workloads.MODEL_CONFIGS, "tiny", dict(TINY))
    monkeypatch.setattr(throughput, "make_workload", lambda name, n: mixed_workload(2, (8, 16), (4, 8), 384))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in GPU")
    seen = {}

    def fake_peer(kind, path, vocab, args, extra):
        seen.update(kind=kind, path=path, extra=extra, quantization=args.quantization, kv=args.kv_cache_dtype)
        return {"vllm_version": "0.26.0", "tok_s": 10.0, "seconds": 1.0, "all_runs_s": [1.0]}, "Machete"
    monkeypatch.setattr(peer_vllm, "peer_result", fake_peer)
    out = tmp_path / "t.json"
    throughput.main(["--device", "cuda", "--model", "tiny", "--peer", "vllm", "--quantization", "w4a16",
                     "--kv-cache-dtype", "fp8", "--repeat", "1", "--max-model-len", "64", "--cache-dir", "",
                     "--out", str(out)])
    res = json.load(open(out))
    assert (res["quantization"], res["kv_cache_dtype"], res["workload"]) == ("w4a16", "fp8", "nano-vllm")
    assert res["atom_linear_formats"] == ["bfloat16", "int4 g128 sym"]  # lm_head bf16, the decoder int4
    assert res["peer"] == "vLLM 0.26.0" and res["peer_note"] == "Machete"
    assert res["speedup_vs_peer"] == pytest.approx(res["atom_tok_s"] / 10.0)
    assert res["roofline_tok_s"] > res["atom_tok_s"] > 0
    assert seen["quantization"] == "w4a16" and seen["kv"] == "fp8" and seen["extra"][-1] == "nano-vllm"
    assert json.load(open(os.path.join(seen["path"], "config.json")))["quantization_config"]["format"] == "pack-quantized"
    table = capsys.readouterr().out
    assert "w4a16, KV fp8" in table and "ATOM" in table and "vLLM 0.26.0" in table and "roofline" in table


def test_latency_run_names_the_format_and_floors_it(tmp_path, monkeypatch, capsys):
    from atom.benchmarks import latency, workloads
    monkeypatch.setitem(workloads.MODEL_CONFIGS, "tiny", dict(TINY))
    monkeypatch.setattr(peer_vllm, "peer_result", lambda *a: (None, "vLLM does not run mxfp4_w4a16 on sm90: x"))
    out = tmp_path / "l.json"
    latency.main(["--model", "tiny", "--batches", "1", "2", "--prompt-len", "8", "--new-tokens", "6", "--modes",
                  "eager", "--peer", "vllm", "--quantization", "mxfp4_w4a16", "--cache-dir", "", "--out", str(out)])
    res = json.load(open(out))
    assert (res["quantization"], res["kv_cache_dtype"]) == ("mxfp4_w4a16", "auto")
    assert res["atom_linear_formats"] == ["bfloat16", "mxfp4 1x32 e8m0, weight only"]
    assert res["peer_note"].startswith("vLLM does not run")
    for r in res["results"]:
        assert r["floor_ms"] == pytest.approx(roofline.decode_floor_ms(TINY, r["batch"], 8 + 3,
                                                                       weight_format="mxfp4_w4a16"))
    table = capsys.readouterr().out
    assert "mxfp4_w4a16, KV auto" in table and "vLLM does not run" in table


def test_moe_routers_stay_bf16_as_the_producer_writes_them():
    from atom.benchmarks.workloads import producer_ignore
    q = producer_ignore(MODEL_CONFIGS["qwen3-30b-a3b"])
    assert q[0] == "model.layers.0.mlp.gate" and len(q) == 49 and q[-1] == "lm_head"
    assert producer_ignore(MODEL_CONFIGS["mixtral-8x7b"])[5] == "model.layers.5.block_sparse_moe.gate"
    assert producer_ignore(MODEL_CONFIGS["deepseek-v2-lite"])[0] == "model.layers.1.mlp.gate"
    assert producer_ignore(MODEL_CONFIGS["llama-3.1-8b"]) == ["lm_head"]
    path = write_model_config("qwen3-30b-a3b", quantization="fp8_dynamic")
    assert json.load(open(os.path.join(path, "config.json")))["quantization_config"]["ignore"] == q


def test_peer_dummy_reaches_the_child_and_the_xavier_refill_follows_atoms_rule(tmp_path):
    import torch
    ap = throughput.argparse.ArgumentParser()
    peer_vllm.add_engine_limit_args(ap)
    peer_vllm.add_format_args(ap)
    ap.add_argument("--repeat", type=int, default=2)
    cmd = peer_vllm.child_command("latency", str(tmp_path), 100, ap.parse_args(["--peer-dummy", "xavier"]), [])
    assert peer_vllm.build_parser().parse_args(cmd[3:]).peer_dummy == "xavier"
    assert peer_vllm.build_parser().parse_args(["latency", "--model-path", "x", "--vocab-size", "9"]).peer_dummy == "vllm"

    class Experts(torch.nn.Module):  # names and shapes as vLLM's modules hold them
        def __init__(self):
            super().__init__()
            self.w13_weight = torch.nn.Parameter(torch.full((4, 64, 96), 5e-4))
            self.input_layernorm_weight = torch.nn.Parameter(torch.full((96,), 5e-4))
            self.o_bias = torch.nn.Parameter(torch.full((96,), 5e-4))
            self.ids = torch.nn.Parameter(torch.zeros(3, dtype=torch.int32), requires_grad=False)
    m = Experts()
    assert peer_vllm.xavier_refill(m) == 3
    assert torch.all(m.input_layernorm_weight == 1) and torch.all(m.o_bias == 0) and torch.all(m.ids == 0)
    std = (2 / (64 + 96)) ** 0.5  # each expert's own fans
    assert abs(m.w13_weight.std().item() / std - 1) < 0.05
