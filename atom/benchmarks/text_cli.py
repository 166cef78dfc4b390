"""The command-line parts the teacher-forced accuracy benchmarks share (`quant_accuracy`,
`quant_mix`): --model / --tokens / --out, the engine sized for the text, and the report."""
from __future__ import annotations

import argparse
import json


def add_text_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--tokens", type=int, default=256, help="tokens of the text (teacher forced), >= 2")
    ap.add_argument("--out")


def engine_for_text(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """The `LLM` of --model with KV blocks for --tokens (checked first: a bad value exits
    through `ap.error` before any model loads); its tokenizer is required (the texts are strings)."""
    from atom import LLM
    if args.tokens < 2:
        ap.error(f"--tokens {args.tokens}: must be >= 2 (one token predicted from the ones before it)")
    llm = LLM(args.model, enable_log_stats=False, num_kvcache_blocks=-(-args.tokens // 16) + 1)
    if llm.tokenizer is None:
        ap.error(f"--model {args.model}: has no tokenizer (the texts are strings)")
    return llm


def report(result: dict, text: str, out: str | None) -> None:
    """The table on stdout (a command's output, not a log) and the JSON at `out`."""
    print(text)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")
