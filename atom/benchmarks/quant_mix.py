"""A format per layer against one format everywhere, at the same size.

    python -m atom.benchmarks.quant_mix [--model embedded] [--candidates mxfp4 ptpc_fp8]
                                        [--sizes w4a16_g64 w4a16_g32 ptpc_fp8] [--tokens 256]
                                        [--out quant_mix.json]

The explorer (`atom.quant`) scores each candidate format one linear layer at a time on
`TEXT`; then, for each size format, `choose_formats` picks a candidate per layer within the
bytes that the size format takes on every linear layer (the LM head stays), and the whole mix
is measured against the uniform configuration: top-1 agreement with the unquantized model,
mean KL and perplexity, teacher forced, on `TEXT` (where the choice was fitted) and on
`HELD_OUT` (text it has not seen). The default candidates are the two formats
`--online_quant_config` takes, so each mix's `config` loads as it is.
"""
from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import torch

from atom.benchmarks.provenance import provenance

logger = logging.getLogger(__name__)

DEFAULT_CANDIDATES = ("mxfp4", "ptpc_fp8")
DEFAULT_SIZES = ("w4a16_g64", "w4a16_g32", "ptpc_fp8")
FIGURES = ("top1", "kl", "ppl", "linear_bytes")


def _figures(r: dict) -> dict:
    return {k: r[k] for k in FIGURES}


def compare_mix(llm, fit_ids: list[int], held_ids: list[int], candidates=DEFAULT_CANDIDATES,
                sizes=DEFAULT_SIZES) -> dict[str, Any]:
    """The benchmark's result for a loaded `LLM` (see the module docstring)."""
    from atom.quant import SensitivityExplorer, choose_formats, mixed_config
    from atom.quant_spec import ONLINE_QUANT_FORMATS

    fit = SensitivityExplorer(llm, fit_ids, max_tokens=len(fit_ids))
    held = SensitivityExplorer(llm, held_ids, max_tokens=len(held_ids))
    t0 = time.perf_counter()
    tables = [fit.run(fmt) for fmt in candidates]
    table_seconds = time.perf_counter() - t0
    guide = set(candidates) <= set(ONLINE_QUANT_FORMATS)
    rows = []
    for size in sizes:
        uniform_cfg = {"global_quant_config": size}
        uniform = fit.evaluate(uniform_cfg)
        choice = choose_formats(tables, uniform["linear_bytes"])
        cfg = mixed_config(choice, guide_formats=guide)
        row = {"size": size, "budget_bytes": uniform["linear_bytes"],
               "formats": choice.groupby("format")["layers"].sum().to_dict(), "config": cfg,
               "uniform": {"fit": _figures(uniform), "held_out": _figures(held.evaluate(uniform_cfg))},
               "mix": {"fit": _figures(fit.evaluate(cfg)), "held_out": _figures(held.evaluate(cfg))}}
        logger.info("%s: %s", size, row)
        rows.append(row)
    return {"benchmark": "quant_mix", "model": str(llm.config.model), "candidates": list(candidates),
            "tokens": {"fit": len(fit.token_ids), "held_out": len(held.token_ids)},
            "config_loads_as_is": guide, "table_seconds": table_seconds, "sizes": rows,
            "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), **provenance()}


def table(result: dict) -> str:
    lines = [f"{result['model']}: candidates {', '.join(result['candidates'])}; fitted on {result['tokens']['fit']} "
             f"tokens, held out {result['tokens']['held_out']}",
             f"{'size of':<10} {'config':<8} {'MiB':>7} {'top1 fit':>9} {'KL fit':>8} {'ppl fit':>8} "
             f"{'top1 held':>10} {'KL held':>8} {'ppl held':>9}"]
    for r in result["sizes"]:
        for kind in ("uniform", "mix"):
            f, h = r[kind]["fit"], r[kind]["held_out"]
            lines.append(f"{r['size']:<10} {kind:<8} {f['linear_bytes'] / 2**20:>7.2f} {f['top1'] * 100:>8.2f}% "
                         f"{f['kl']:>8.4f} {f['ppl']:>8.3f} {h['top1'] * 100:>9.2f}% {h['kl']:>8.4f} {h['ppl']:>9.3f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    from atom.benchmarks.text_cli import add_text_args, engine_for_text, report
    from atom.model_ops.quant.online import FORMATS
    from atom.quant.text import HELD_OUT, TEXT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidates", nargs="+", default=list(DEFAULT_CANDIDATES), choices=FORMATS, metavar="FORMAT",
                    help=f"formats a layer may get (default: the online_quant_config ones): {', '.join(FORMATS)}")
    ap.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), choices=FORMATS, metavar="FORMAT",
                    help="uniform formats whose size each mix gets (default: %(default)s)")
    add_text_args(ap)
    args = ap.parse_args(argv)
    llm = engine_for_text(ap, args)
    encode = llm.tokenizer.encode
    result = compare_mix(llm, encode(TEXT)[:args.tokens], encode(HELD_OUT)[:args.tokens], args.candidates, args.sizes)
    report(result, table(result), args.out)


if __name__ == "__main__":
    main()
