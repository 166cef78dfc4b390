"""Answer a few chat prompts with the embedded default model (SmolLM2-135M-Instruct).

    python -m atom.examples.simple_inference [--model PATH] [--max-tokens N] [--temperature T]
"""
from __future__ import annotations

import argparse
import logging

from rich.console import Console
from rich.table import Table

from atom import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", help="model folder, or 'embedded' (default)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    llm = LLM(args.model, max_model_len=2048, enable_log_stats=False)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], sp)

    table = Table(title=f"ATOM — {args.model}", show_lines=True)
    for col in ("prompt", "answer", "tokens", "ttft s", "tok/s"):
        table.add_column(col)
    for p, o in zip(PROMPTS, outputs):
        rate = f"{1 / o.tpot:.1f}" if o.tpot else "-"
        table.add_row(p, o.text.strip(), str(o.num_output_tokens), f"{o.ttft:.2f}", rate)
    Console().print(table)


if __name__ == "__main__":
    main()
