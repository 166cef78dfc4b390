"""Write tiny quantized checkpoints with the real producers, and their references.

Run with the producers' Python (the Makefile's `.venv-prod`: llmcompressor 0.14.0.1,
compressed-tensors 0.19.0, amd-quark 0.13, torch 2.13.0 CPU, transformers 5.17), never the
engine's:

    .venv-prod/bin/python tests/producers/make_checkpoints.py OUT_DIR [SCHEME ...]

(no SCHEME: every tiny one; `smollm2_ct_fp8_dynamic` also needs $ATOM_SMOLLM2_BASE, the
engine's embedded SmolLM2 folder.)

For each scheme it builds a tiny random Llama or Qwen3 (bf16, seed 0, initializer_range
0.4 so greedy tokens are decisive; hidden 256 for the presets with 128-wide groups), quantizes it with llm-compressor (`oneshot`) or AMD
Quark (`ModelQuantizer` + `export_safetensors`) exactly as QUANT_PRODUCERS.md's snippets
do, saves the checkpoint in OUT_DIR/SCHEME, and writes OUT_DIR/SCHEME/reference.json:
- `prompts`: token-id prompts; `greedy`: 8 greedy tokens per prompt from transformers
  reloading the checkpoint in fp32 (dense models reload correctly: QUANT_PRODUCERS.md);
- `logprobs`: per prompt, the reload's log-softmax of each greedy token;
- `inprocess_vs_reload`: max |logit| difference between the producer's in-process
  fake-quantized model (bf16; fp32 for quark_mxfp4, whose bf16 MXFP4 activation kernel
  is CUDA-only) and transformers' reload in the same dtype on the same ids: 0 or a few
  ulps when the reload is a faithful reference.
The test process (the engine's venv) only reads these files.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch

logging.basicConfig(level=logging.WARNING)
log = logging.getLogger("make_checkpoints")

VOCAB = 512
N_NEW = 8


def base_config(arch: str):
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, initializer_range=0.4,
                  max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=16, rope_theta=1e6, **common)
    if arch == "llama_wide":  # every product's K a multiple of 128: the presets' 128-wide blocks / groups
        common.update(hidden_size=256, intermediate_size=512)
    return transformers.LlamaConfig(rope_theta=10000.0, **common)


def tiny_tokenizer():
    """A word-level tokenizer over VOCAB made-up words (no download)."""
    import tokenizers
    import transformers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="<unk>")


def base_model(arch: str, root: str):
    """The tiny random model, saved once under root/_base_ARCH and loaded from there (the
    producers read the model's name_or_path)."""
    import transformers
    if arch == "smollm2":  # the engine's embedded SmolLM2 (fp32 safetensors), read in bf16
        path = os.environ.get("ATOM_SMOLLM2_BASE", "")
        if not os.path.exists(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"ATOM_SMOLLM2_BASE={path!r} is not a model folder: set it to the "
                                    "embedded SmolLM2 (python -m atom.model_loader.embedded prints it)")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    path = os.path.join(root, f"_base_{arch}")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(base_config(arch), dtype=torch.bfloat16)
        model.save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)  # llm-compressor wants a processor with a dataset
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def calib_dataset():
    import datasets
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (8, 32), generator=g).tolist()
    return dict(dataset=datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32] * 8}),
                num_calibration_samples=8, max_seq_length=32)


def llmc_recipe(scheme: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier
    scheme = scheme.replace("smollm2_", "")
    ignore = ["lm_head"]
    presets = {"ct_fp8_dynamic": "FP8_DYNAMIC", "ct_w8a8": "W8A8", "ct_mxfp4a16": "MXFP4A16", "ct_mxfp4": "MXFP4",
               "ct_fp8_static": "FP8", "ct_fp8_block": "FP8_BLOCK", "ct_w4a16": "W4A16"}
    if scheme in presets:
        return QuantizationModifier(scheme=presets[scheme], targets="Linear", ignore=ignore)
    if scheme == "ct_fp8_block32":
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[32, 32])
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group", group_size=32, dynamic=True)
    elif scheme.startswith("ct_w4a16_g"):
        group = int(scheme.removeprefix("ct_w4a16_g").removesuffix("_asym"))
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=not scheme.endswith("_asym"),
                                   strategy="group", group_size=group)
        acts = None
    else:
        raise ValueError(f"unknown llm-compressor scheme {scheme!r}")
    return QuantizationModifier(ignore=ignore, config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=acts)})


def produce_llmc(scheme: str, arch: str, out: str, probe: torch.Tensor) -> torch.Tensor:
    from llmcompressor import oneshot
    model = base_model(arch, os.path.dirname(out))
    calib = calib_dataset() if scheme == "ct_fp8_static" else {}
    oneshot(model=model, recipe=llmc_recipe(scheme), **calib)
    with torch.no_grad():
        ref = model(probe).logits.float()
    model.save_pretrained(out, save_compressed=True)
    return ref


def produce_quark(scheme: str, arch: str, out: str, probe: torch.Tensor) -> torch.Tensor:
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
    model = base_model(arch, os.path.dirname(out))
    name = scheme.removeprefix("quark_")
    qcfg = LLMTemplate.get(model.config.model_type).get_config(scheme=name)
    dl = None
    if name in ("fp8", "int8"):  # static activation scales need calibration data
        g = torch.Generator().manual_seed(1)
        dl = torch.utils.data.DataLoader(torch.randint(3, VOCAB, (8, 32), generator=g), batch_size=1)
    model = ModelQuantizer(qcfg).quantize_model(model, dl)
    model = ModelQuantizer.freeze(model)
    with torch.no_grad():
        export_safetensors(model, out)
        if name == "mxfp4":  # Quark's bf16 dynamic-MXFP4 kernel is CUDA-only; its fp32 path runs anywhere
            torch.nn.Module.to(model, torch.float32)
        return model(probe).logits.float()


#: scheme -> (producer, tiny architecture)
SCHEMES = {
    "ct_fp8_dynamic": ("llmc", "qwen3"),
    "smollm2_ct_fp8_dynamic": ("llmc", "smollm2"),  # 163 MB; base from $ATOM_SMOLLM2_BASE
    "ct_fp8_block32": ("llmc", "qwen3"),
    "ct_fp8_block": ("llmc", "llama_wide"),  # the FP8_BLOCK preset: 128x128 weights, 1x128 activations
    "ct_w4a16": ("llmc", "llama_wide"),  # the W4A16 preset: int4 g128
    "ct_fp8_static": ("llmc", "llama"),
    "ct_w8a8": ("llmc", "qwen3"),
    "ct_w4a16_g32": ("llmc", "llama"),
    "ct_w4a16_g64_asym": ("llmc", "qwen3"),
    "ct_mxfp4a16": ("llmc", "qwen3"),
    "ct_mxfp4": ("llmc", "llama"),
    "quark_ptpc_fp8": ("quark", "qwen3"),
    "quark_fp8": ("quark", "llama"),
    "quark_int4_wo_32": ("quark", "qwen3"),
    "quark_int4_wo_64": ("quark", "llama"),
    "quark_mxfp4": ("quark", "qwen3"),
    "quark_mxfp4_weight_only": ("quark", "llama"),
}


SMOLLM2_TEXTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


def prompts(arch: str = "tiny") -> list[list[int]]:
    if arch == "smollm2":
        import transformers
        tok = transformers.AutoTokenizer.from_pretrained(os.environ["ATOM_SMOLLM2_BASE"])
        return [tok(t)["input_ids"] for t in SMOLLM2_TEXTS]
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40)]


def reload_fp32(out: str, probe: torch.Tensor):
    """transformers' reload of `out` running fp32. compressed-tensors' MXFP4 decompresses to
    bf16 weights whatever the dtype asked (fp32 then fails: "expected m1 and m2 to have the
    same dtype"); there the model is reloaded in bf16, decompressed by one forward and cast
    to fp32 (fp4 x 2^k is exact in bf16, so nothing is lost)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    try:
        with torch.no_grad():
            model(probe)
        return model
    except RuntimeError as exc:
        if "same dtype" not in str(exc):
            raise
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        model(probe)
    return torch.nn.Module.to(model, torch.float32)  # PreTrainedModel.float() refuses quantized models


def reload_reference(out: str, probe: torch.Tensor, arch: str) -> dict:
    """Greedy tokens and their log-probs from transformers reloading `out` in fp32."""
    model = reload_fp32(out, probe)
    greedy, logprobs = [], []
    with torch.no_grad():
        for p in prompts(arch):
            ids = list(p)
            for _ in range(N_NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            new = ids[len(p):]
            greedy.append(new)
            logprobs.append([float(lp[len(p) - 1 + i, t]) for i, t in enumerate(new)])
    return {"model": model, "prompts": prompts(arch), "greedy": greedy, "logprobs": logprobs}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    root, names = argv[0], argv[1:] or [n for n in SCHEMES if not n.startswith("smollm2")]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        print(f"unknown schemes {unknown}: choose from {sorted(SCHEMES)}", file=sys.stderr)
        return 2
    for name in names:
        producer, arch = SCHEMES[name]
        probe = torch.tensor([prompts(arch)[1]])
        out = os.path.join(root, name)
        if os.path.exists(os.path.join(out, "reference.json")):
            continue
        t0 = time.time()
        make = produce_llmc if producer == "llmc" else produce_quark
        inproc = make(name, arch, out, probe)
        ref = reload_reference(out, probe, arch)
        fp32 = ref.pop("model")
        with torch.no_grad():
            if name == "quark_mxfp4":
                reloaded = fp32(probe).logits.float()
            else:
                import transformers
                bf16 = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
                reloaded = bf16(probe).logits.float()
        ref.update(scheme=name, producer=producer, arch=arch,
                   inprocess_vs_reload=float((inproc - reloaded).abs().max()),
                   logit_absmax=float(reloaded.abs().max()), seconds=round(time.time() - t0, 2))
        with open(os.path.join(out, "reference.json"), "w") as fh:
            json.dump(ref, fh)
        print(f"{name}: {ref['seconds']} s, in-process vs reload {ref['inprocess_vs_reload']:.3g} "
              f"(|logit| max {ref['logit_absmax']:.3g})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
