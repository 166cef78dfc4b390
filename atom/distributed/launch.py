"""The per-host launcher a cluster scheduler starts on every host of a multi-host run.

    # host A (data-parallel ranks 0-1; the front end, answers the prompts):
    python -m atom.distributed.launch --model M -dp 4 --data-parallel-size-local 2 \\
        --data-parallel-rank 0 --data-parallel-master-ip 10.0.0.1 --data-parallel-master-port 29500 \\
        --prompt "Hello" --max-tokens 16
    # host B (ranks 2-3): the same, with --data-parallel-rank 2 and no prompts
    python -m atom.distributed.launch --model M -dp 4 --data-parallel-size-local 2 \\
        --data-parallel-rank 2 --data-parallel-master-ip 10.0.0.1 --data-parallel-master-port 29500

Every `EngineArgs` flag applies (`-tp 2` gives each replica two ranks), plus where this host
sits in the data-parallel layout (`ParallelConfig`'s fields; the `ATOM_DP_*` variables
override them, so a scheduler may set those per host instead). The host of rank 0 serves
the TCP store the replicas meet on at the master ip / port, runs its replicas and the
router, answers the prompts (`--prompt`, `--prompt-file`, `--prompt-ids 1,2,3`, or stdin)
as `atom`'s command line does, then stops every replica; the other hosts run their
replicas until then. Exit status: 0 served, 1 a prompt refused or a replica failed,
2 a bad setting.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from atom.config import ParallelConfig
from atom.entrypoint import build_parser, read_prompts, sampling_params_from_args


def add_placement_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = ParallelConfig.__dataclass_fields__
    g = parser.add_argument_group("placement (ParallelConfig; ATOM_DP_* override)")
    g.add_argument("--data-parallel-size-local", type=int, default=None,
                   help="Replicas on this host (default: all of -dp, one host).")
    g.add_argument("--data-parallel-rank", type=int, default=d["data_parallel_rank"].default,
                   help="Global data-parallel rank of this host's first replica.")
    g.add_argument("--data-parallel-master-ip", type=str, default=d["data_parallel_master_ip"].default,
                   help="Address of rank 0's host (its TCP store).")
    g.add_argument("--data-parallel-master-port", type=int, default=d["data_parallel_master_port"].default,
                   help="Port of rank 0's TCP store.")
    g.add_argument("--data-parallel-base-port", type=int, default=d["data_parallel_base_port"].default,
                   help="Tensor-parallel stores: base + 1 + dp rank (0: the OS picks).")
    g.add_argument("--master-addr", type=str, default="127.0.0.1",
                   help="Address this host's tensor-parallel stores listen on.")
    g.add_argument("--dp-load-balance", type=str, default="least_requests",
                   help="Router strategy: round_robin, least_requests, least_tokens.")
    g.add_argument("--prompt-ids", action="append", default=None, metavar="IDS",
                   help="A prompt as comma-separated token ids (repeatable).")
    return parser


def config_kwargs(args: argparse.Namespace) -> dict:
    from atom.model_engine.arg_utils import EngineArgs
    kwargs = EngineArgs.from_cli_args(args)._config_kwargs()
    kwargs["parallel_config"] = ParallelConfig(
        data_parallel_size=args.data_parallel_size, data_parallel_size_local=args.data_parallel_size_local,
        data_parallel_rank=args.data_parallel_rank, data_parallel_master_ip=args.data_parallel_master_ip,
        data_parallel_master_port=args.data_parallel_master_port,
        data_parallel_base_port=args.data_parallel_base_port)
    kwargs["master_addr"] = args.master_addr
    kwargs["dp_load_balance"] = args.dp_load_balance
    return kwargs


def main(argv: list[str] | None = None) -> int:
    parser = add_placement_args(build_parser())
    parser.prog = "python -m atom.distributed.launch"
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        kwargs = config_kwargs(args)
        pc = kwargs["parallel_config"]
        if pc.data_parallel_rank != 0:  # not the front end's host: serve this host's replicas
            from atom.config import Config
            from atom.distributed.data_parallel import serve_replicas
            from atom.model_engine.supported import check_supported
            config = Config(**kwargs)
            check_supported(config)
            return serve_replicas(config)
        sp = sampling_params_from_args(args)
        prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids or []]
        if not prompts or args.prompt is not None or args.prompt_file is not None:
            prompts += read_prompts(args)
        if not prompts:
            parser.error("no prompts: pass --prompt, --prompt-ids, --prompt-file or lines on stdin")
        from atom.llm import LLM
        model = kwargs.pop("model")
        llm = LLM(model, dtype=args.dtype, seed=args.seed, **kwargs)
    except (ValueError, TypeError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    status = 0
    try:
        outputs = llm.generate(prompts, sp, use_tqdm=False)
        for i, out in enumerate(outputs):
            if out.finish_reason == "error":
                print(f"{parser.prog}: prompt {i} refused: {out.error}", file=sys.stderr)
                status = 1
            print(json.dumps({"prompt": prompts[i], "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "error": out.error}))
        sys.stdout.flush()
    finally:
        llm.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
