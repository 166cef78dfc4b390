"""Answer a few chat prompts with the embedded default model (SmolLM2-135M-Instruct).

    python -m atom.examples.simple_inference [--model PATH] [--max-tokens N] [--temperature T]

Takes every flag of `python -m atom.entrypoint` (the engine's `EngineArgs`, the sampling
flags, `--prompt` / `--prompt-file`), with defaults for a demo: the embedded model,
max_model_len 2048, level 0, greedy, 64 tokens, three built-in prompts.
"""
from __future__ import annotations

import logging

from rich.console import Console
from rich.table import Table

from atom.entrypoint import build_parser, read_prompts, sampling_params_from_args
from atom.model_engine.arg_utils import EngineArgs

PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
]


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    ap.prog, ap.description = "python -m atom.examples.simple_inference", __doc__
    ap.set_defaults(model="embedded", max_model_len=2048, enable_log_stats=False, level=0,
                    temperature=0.0, max_tokens=64)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    prompts = PROMPTS if args.prompt is None and args.prompt_file is None else read_prompts(args)
    try:
        sp = sampling_params_from_args(args)
        llm = EngineArgs.from_cli_args(args).create_llm()
    except (ValueError, TypeError, OSError) as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp)

    table = Table(title=f"ATOM — {args.model}", show_lines=True)
    for col in ("prompt", "answer", "tokens", "ttft s", "tok/s"):
        table.add_column(col)
    for p, o in zip(prompts, outputs):
        rate = f"{1 / o.tpot:.1f}" if o.tpot else "-"
        table.add_row(p, o.text.strip(), str(o.num_output_tokens), f"{o.ttft:.2f}" if o.ttft else "-", rate)
    Console().print(table)


if __name__ == "__main__":
    main()
