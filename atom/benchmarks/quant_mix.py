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
import json
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
    from atom import LLM
    from atom.model_ops.quant.online import FORMATS
    from atom.quant.text import HELD_OUT, TEXT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--candidates", nargs="+", default=list(DEFAULT_CANDIDATES), choices=FORMATS, metavar="FORMAT",
                    help=f"formats a layer may get (default: the online_quant_config ones): {', '.join(FORMATS)}")
    ap.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), choices=FORMATS, metavar="FORMAT",
                    help="uniform formats whose size each mix gets (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens of each text (teacher forced), >= 2")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.tokens < 2:
        ap.error(f"--tokens {args.tokens}: must be >= 2 (one token predicted from the ones before it)")
    llm = LLM(args.model, enable_log_stats=False, num_kvcache_blocks=-(-args.tokens // 16) + 1)
    if llm.tokenizer is None:
        ap.error(f"--model {args.model}: has no tokenizer (the texts are strings)")
    result = compare_mix(llm, llm.tokenizer.encode(TEXT)[:args.tokens], llm.tokenizer.encode(HELD_OUT)[:args.tokens],
                         args.candidates, args.sizes)
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
