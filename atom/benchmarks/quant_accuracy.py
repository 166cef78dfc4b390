"""Accuracy of each quantized format against the unquantized model, beside a plain RTN
fake-quantized copy of the model (the numerics reference).

    python -m atom.benchmarks.quant_accuracy [--model embedded] [--formats ptpc_fp8 ...]
                                             [--tokens 256] [--out quant_accuracy.json]

For every format: the engine quantizes every linear layer online (the LM head stays; a
layer whose shape the format cannot hold, e.g. fp8 128x128 blocks over 576 inputs, is
left unquantized in both the engine and the reference, and counted), then, teacher forced
on a text, reports top-1 agreement with the unquantized engine, mean KL(unquantized ||
quantized) and perplexity; the reference (`quant_reference`, transformers with each
nn.Linear fake-quantized, written independently of the engine's methods) reports the same
against unquantized transformers. `within_1_point`: the engine's top-1 agreement is within
one percentage point of the reference's. A format the engine cannot run on
the model (a refusal) gets the reference's figures and the engine's reason.
"""
from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import torch

from atom.benchmarks.provenance import provenance

logger = logging.getLogger(__name__)

DEFAULT_FORMATS = ("ptpc_fp8", "fp8_block", "w8a8_int8", "w4a16_g64", "w4a16_g32", "mxfp4")


def _figures(s: dict) -> dict:
    return {"top1": s["top1"], "kl": s["kl"], "ppl": s["ppl"]}


def compare(llm, token_ids: list[int], formats=DEFAULT_FORMATS, hf_model=None) -> dict[str, Any]:
    """The benchmark's result for a loaded `LLM` on `token_ids` (see the module docstring);
    `hf_model`: the transformers model of the same weights (default: loaded from its path)."""
    import transformers

    from atom.benchmarks.quant_reference import fake_quantized_copy
    from atom.model_loader.online_quant import layer_aliases
    from atom.model_ops.quant.online import refusal, target_for
    from atom.quant import SensitivityExplorer, hf_logits, scores

    ex = SensitivityExplorer(llm, token_ids, max_tokens=len(token_ids))
    if hf_model is None:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(llm.config.model, dtype=torch.float32).eval()
    hf_base = hf_logits(hf_model, ex.token_ids)
    model = ex.runner.model
    rows = []
    for fmt in formats:
        row: dict[str, Any] = {"format": fmt}
        t0 = time.perf_counter()
        skip: list[str] = []
        try:
            for name, layer in ex.layers.items():
                if refusal(target_for(fmt, name), layer) is not None:
                    skip.append(name)
            cfg = {"global_quant_config": fmt, "exclude_layer": skip}
            e = ex.evaluate(cfg)
            row["engine"] = _figures(e)
            row["layers_quantized"] = e["layers_quantized"]
        except NotImplementedError as exc:
            row["engine"] = None
            row["engine_reason"] = str(exc)
        hf_skip = {a for n in skip for a in layer_aliases(n, model)}
        ref = fake_quantized_copy(hf_model, fmt, only=lambda name, _m: name not in hf_skip)
        row["reference"] = _figures(scores(hf_base, hf_logits(ref, ex.token_ids), ex.token_ids))
        del ref
        row["layers_left_unquantized"] = skip
        if row["engine"] is not None:
            row["top1_diff_points"] = 100 * (row["engine"]["top1"] - row["reference"]["top1"])
            row["within_1_point"] = abs(row["top1_diff_points"]) <= 1.0
        row["seconds"] = time.perf_counter() - t0
        logger.info("%s: %s", fmt, row)
        rows.append(row)
    base = scores(ex.base, ex.base, ex.token_ids)
    hf_ppl = scores(hf_base, hf_base, ex.token_ids)["ppl"]
    return {"benchmark": "quant_accuracy", "model": str(llm.config.model), "tokens": len(ex.token_ids),
            "ppl_unquantized": {"engine": base["ppl"], "reference": hf_ppl}, "formats": rows,
            "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), **provenance()}


def table(result: dict) -> str:
    lines = [f"{result['model']}: {result['tokens']} tokens, unquantized ppl engine "
             f"{result['ppl_unquantized']['engine']:.3f} / reference {result['ppl_unquantized']['reference']:.3f}",
             f"{'format':<11} {'engine top1':>11} {'ref top1':>9} {'engine KL':>10} {'ref KL':>9} "
             f"{'engine ppl':>10} {'ref ppl':>9}  within 1 pt"]
    for r in result["formats"]:
        e, ref = r["engine"], r["reference"]
        if e is None:
            eng = f"{'n/a':>11} {ref['top1'] * 100:>8.2f}% {'n/a':>10} {ref['kl']:>9.4f} {'n/a':>10} {ref['ppl']:>9.3f}"
            lines.append(f"{r['format']:<11} {eng}  ({r['engine_reason'][:60]}...)")
            continue
        lines.append(f"{r['format']:<11} {e['top1'] * 100:>10.2f}% {ref['top1'] * 100:>8.2f}% {e['kl']:>10.4f} "
                     f"{ref['kl']:>9.4f} {e['ppl']:>10.3f} {ref['ppl']:>9.3f}  {r['within_1_point']}"
                     + (f" ({len(r['layers_left_unquantized'])} layers left out)" if r["layers_left_unquantized"] else ""))
    return "\n".join(lines)


def main(argv=None) -> None:
    from atom.benchmarks.text_cli import add_text_args, engine_for_text, report
    from atom.model_ops.quant.online import FORMATS
    from atom.quant.text import TEXT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS), choices=FORMATS, metavar="FORMAT",
                    help=f"formats to compare (default: all): {', '.join(FORMATS)}")
    add_text_args(ap)
    args = ap.parse_args(argv)
    llm = engine_for_text(ap, args)
    result = compare(llm, llm.tokenizer.encode(TEXT)[:args.tokens], args.formats)
    report(result, table(result), args.out)


if __name__ == "__main__":
    main()
