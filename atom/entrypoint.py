"""The command line of the configuration guide: every `EngineArgs` flag, then generate.

    python -m atom.entrypoint --model embedded --prompt "Hello" --max-tokens 16 --level 0
    atom --model /models/Qwen3-0.6B --prompt-file prompts.txt --temperature 0.7 --jsonl
    echo "Hello" | atom --model embedded

Prompts come from `--prompt` (repeatable), `--prompt-file FILE` (one per line, blank lines
skipped) or, when neither is given, stdin (one per line). Each completion is printed to
stdout, one after another (`--jsonl`: one JSON object per prompt with prompt, text,
token_ids and finish_reason). A bad setting, or one this build cannot honour on this
machine (`atom.model_engine.supported`), exits with status 2 and a one-line message on
stderr; a prompt that cannot be served is reported on stderr and makes the status 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from atom.model_engine.arg_utils import EngineArgs
from atom.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0).")
    g.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate per prompt.")
    g.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass, (0, 1].")
    g.add_argument("--top-k", type=int, default=-1, help="Keep the k likeliest tokens (-1: off).")
    g.add_argument("--ignore-eos", action="store_true", help="Keep generating past EOS.")
    g.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="Stop at this string (repeatable; trimmed from the output).")
    return parser


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                          top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos,
                          stop_strings=args.stop)


def add_prompt_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", default=None, help="A prompt (repeatable).")
    g.add_argument("--prompt-file", type=str, default=None, metavar="FILE",
                   help="A file of prompts, one per line.")
    g.add_argument("--jsonl", action="store_true",
                   help="Print one JSON object per prompt instead of the plain completion.")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atom", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    add_sampling_args(parser)
    add_prompt_args(parser)
    return parser


def read_prompts(args: argparse.Namespace, stdin=None) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if args.prompt is None and args.prompt_file is None:
        stdin = stdin if stdin is not None else sys.stdin
        if stdin.isatty():
            print("reading prompts from stdin, one per line (Ctrl-D ends)", file=sys.stderr)
        prompts = [line.rstrip("\n") for line in stdin if line.strip()]
    return prompts


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        sp = sampling_params_from_args(args)
        prompts = read_prompts(args)
        if not prompts:
            parser.error("no prompts: pass --prompt, --prompt-file or lines on stdin")
        llm = EngineArgs.from_cli_args(args).create_llm()
    except (ValueError, TypeError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    outputs = llm.generate(prompts, sp, use_tqdm=False)
    status = 0
    for i, out in enumerate(outputs):
        if out.finish_reason == "error":
            print(f"{parser.prog}: prompt {i} refused: {out.error}", file=sys.stderr)
            status = 1
        if args.jsonl:
            print(json.dumps({"prompt": prompts[i], "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "error": out.error}))
        elif out.finish_reason != "error":
            print(out.text)
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
