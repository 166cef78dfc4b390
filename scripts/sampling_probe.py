"""GPU time of the sampling kernel (`atom.model_ops.kernels.sampling`) at the benchmark
models' vocab sizes and decode batch sizes: temperature sampling and greedy, with the vocab
split over programs (the default) and with one program per row (the split switched off),
against torch's argmax and against the time to read the logits once at HBM bandwidth.
A diagnosis tool behind docs/perf's sampling figures, not a benchmark.

    python3 scripts/sampling_probe.py --out probe.json
    python3 scripts/sampling_probe.py --out probe.json --against /path/to/other/sampling.py

(`--against`: another copy of the kernel module, e.g. from an installed release, timed beside it.)

Times are medians of CUDA-graph replays of one call (graph launch included).
"""
from __future__ import annotations

import argparse
import importlib.util
import json

import torch

from atom.benchmarks.roofline import H200_BANDWIDTH
from atom.model_ops.kernels import sampling
from atom.utils.cuda_timing import graph_time


def _module(path: str):
    """Another copy of the sampling module (a file path), for a side-by-side."""
    spec = importlib.util.spec_from_file_location("sampling_against", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def probe(vocabs=(128256, 151936), rows=(1, 64, 200, 256), against=None) -> dict:
    out = {}
    default_target = sampling._TARGET_PROGRAMS
    for V in vocabs:
        for S in rows:
            logits = torch.randn(S, V, device="cuda", dtype=torch.bfloat16)
            temps = torch.full((S,), 0.6, device="cuda")
            row = {"read_once_us": round(logits.numel() * 2 / H200_BANDWIDTH * 1e6, 2),
                   "torch_argmax_us": round(graph_time([lambda: logits.argmax(-1)]) * 1e6, 2)}
            for name, target in (("split", default_target), ("one_program_per_row", 1)):
                sampling._TARGET_PROGRAMS = target
                try:
                    row[f"{name}_sample_us"] = round(graph_time([lambda: sampling.gumbel_sample(logits, temps, 5)]) * 1e6, 2)
                    row[f"{name}_greedy_us"] = round(graph_time([lambda: sampling.gumbel_sample(logits, None)]) * 1e6, 2)
                finally:
                    sampling._TARGET_PROGRAMS = default_target
            if against is not None:
                row["against_sample_us"] = round(graph_time([lambda: against.gumbel_sample(logits, temps, 5)]) * 1e6, 2)
                row["against_greedy_us"] = round(graph_time([lambda: against.gumbel_sample(logits, None)]) * 1e6, 2)
            out[f"V={V} rows={S}"] = row
            print(f"V={V} rows={S}: {row}", flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--against", metavar="PATH", help="also time the sampling module at PATH (another version)")
    args = ap.parse_args(argv)
    against = _module(args.against) if args.against else None
    res = {"device": torch.cuda.get_device_name(), "against": args.against,
           "results": probe(rows=(1, 8, 64, 128, 200, 256), against=against)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
