"""Times the one-row 4-bit GEMV (`kernels/w4_gemv1.py`) at M = 1 on the Llama-3.1-8B linear
shapes for a few tiles, beside the GEMV it replaces at M = 1 (`w4_gemm._w4_gemv_kernel`) and
bf16 `F.linear`, and prints TB/s of the stored weight next to the ~4.3 TB/s HBM limit. A tuning
probe for `w4_gemv1.TILES`, not a benchmark: JSON of every timing to --out.

    python3 scripts/w4_gemv1_sweep.py --out w4_gemv1_sweep.json [--formats int4 int4_asym mxfp4 mxfp4_pairs]
    python3 scripts/w4_gemv1_sweep.py --out o.json --options   # the table's tile with each of OPTIONS

mxfp4_pairs: the MXFP4 weights as pair words (`kernels.fp4_pairs`, the plan's "fp4_pair_words").

Each timing replays a CUDA graph over enough weight copies to miss L2 (`w4_sweep`'s helpers).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_sweep import FORMATS as W4_FORMATS  # noqa: E402
from w4_sweep import HBM_TBS, SHAPES, copies, nbytes, packed_weights, probe_args, write_rows  # noqa: E402

FORMATS = dict(W4_FORMATS, mxfp4_pairs=("mxfp4_pairs", 32, False))

# (BLOCK_N, num_warps, AHEAD, HALF2, DW, CHAIN): BLOCK_W is 32 x num_warps (DW words a thread a
# row, one load); HALF2: fp16 products (the float32 products once, for reference); CHAIN: a word
# pair's products in one fp16 chain
TILES = [(8, 8, True, False, 1, False),
         (8, 8, False, True, 1, False), (16, 4, False, True, 1, False), (4, 8, True, True, 1, False),
         (8, 8, True, True, 1, False), (8, 4, True, True, 1, False), (16, 4, True, True, 1, False),
         (8, 8, False, True, 2, False), (4, 8, False, True, 2, False), (8, 4, False, True, 2, False),
         (16, 4, False, True, 2, False), (32, 2, False, True, 2, False), (8, 8, True, True, 2, False),
         (4, 8, True, True, 2, False), (8, 4, True, True, 2, False), (4, 4, True, True, 2, False),
         (16, 4, True, True, 2, False), (8, 2, True, True, 2, False), (16, 2, True, True, 2, False),
         (16, 4, False, True, 2, True), (8, 8, True, True, 2, True), (8, 4, True, True, 2, True),
         (16, 4, True, True, 2, True), (8, 2, True, True, 2, True), (16, 2, True, True, 2, True)]

# --options: the table's tile as it is (SPF on; MXFP4's register cap: 64, the deep tile 128), then with each of these
# (SPF off: the scale rows not asked of L2 at the start; the kernel's L2D: L2 prefetches that many
# steps ahead, with the next words carried in registers or, AHEAD off, loaded in the step that
# uses them (int4 at its top; MXFP4's loops spread them through it); STAGES: the loop's loads
# pipelined through shared memory, AHEAD off; WCACHE ".cg": the word loads cached in L2 only;
# PF1: SPF's and L2D's scale lines into L1 too, where the steps' scale loads look first;
# maxnreg: Triton's register cap, e.g. 8 instead of 7 programs an SM for int4's wide tile at 71)
OPTIONS = [{}, dict(SPF=False), dict(L2D=1), dict(L2D=2), dict(AHEAD=False, STAGES=2), dict(AHEAD=False, STAGES=3),
           dict(AHEAD=False, STAGES=3, L2D=2), dict(WCACHE=".cg"), dict(AHEAD=False, L2D=1),
           dict(AHEAD=False, L2D=2), dict(maxnreg=64), dict(maxnreg=64, L2D=1), dict(WCACHE=".cg", PF1=True),
           dict(WCACHE=".cg", PF1=True, L2D=1)]


def weights(fmt: str, N: int, K: int, g: int, zp: bool):
    """Random packed weights of a sweep format (pair words: MXFP4's, repacked)."""
    if fmt != "mxfp4_pairs":
        return packed_weights(fmt, N, K, g, zp)
    from atom.model_ops.kernels.fp4_pairs import pair_words
    packed, scales, zeros = packed_weights("mxfp4", N, K, g, zp)
    return pair_words(packed.view(torch.int32)), scales, zeros


def main(argv=None) -> int:
    args = probe_args(__doc__, argv, formats=dict(nargs="*", default=list(FORMATS), choices=list(FORMATS)),
                      options=dict(action="store_true", help="time the table's tile with each of OPTIONS"))
    if args is None:
        return 2
    from atom.model_ops.kernels import w4_gemm, w4_gemv1
    from atom.model_ops.kernels.w4_gemm import w4_config, w4_linear_launch
    from atom.utils.cuda_timing import graph_time
    rows = []
    print(f"{'format':<10}{'N':>6}{'K':>6} {'best us':>8}{'TB/s':>6}{'%HBM':>5}{'old us':>8}{'x old':>6}"
          f"{'bf16 us':>8}{'x bf16':>7}  best tile (table {w4_gemm.w4_config(1, 4096, 4096)[1]})")
    for N, K in SHAPES:
        w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ws16 = [w16] + [w16.clone() for _ in range(copies(nbytes(w16)) - 1)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        t16 = graph_time([lambda w=w: F.linear(x, w) for w in ws16], iters=args.iters)
        del ws16, w16
        for name in args.formats:
            fmt, g, zp = FORMATS[name]
            one = weights(fmt, N, K, g, zp)
            sets = [one] + [tuple(t.clone() if t is not None else None for t in one)
                            for _ in range(copies(nbytes(*one)) - 1)]
            wbytes = nbytes(*one)

            def timed(cfg, sets=sets, fmt=fmt, g=g):
                calls = [lambda s=s: w4_linear_launch(x, s[0], s[1], s[2], None, fmt, g, K, config=cfg) for s in sets]
                return graph_time(calls, iters=args.iters)
            ref = w4_gemm.w4_linear_ref(x.float(), *one, None, fmt, g, K)
            old = dict(w4_gemm.GEMV_TILES_NARROW if N <= w4_gemm.NARROW_N else w4_gemm.GEMV_TILES, BLOCK_M=1,
                       kernel="w4_gemv")
            t_old = timed(old)
            best = None
            table = w4_config(1, N, K, torch.bfloat16, g, fmt)[1]
            words = one[0] if one[0].dtype == torch.int32 else one[0].view(torch.int32)
            if args.options:
                time_options(rows, name, N, K, x, one, table, timed, ref, wbytes, t_old, t16)
                del sets, one
                continue
            for bn, warps, ahead, half2, dw, chain in TILES:
                if dw == 2 and not w4_gemv1.pairs_words(words, bn, 32 * warps, g):
                    continue  # the launcher would run one word a load (and no CHAIN): timed as such already
                cfg = dict(kernel="w4_gemv1", BLOCK_N=bn, BLOCK_W=32 * warps, num_warps=warps, num_stages=3,
                           AHEAD=ahead, HALF2=half2, DW=dw, CHAIN=chain)
                y = w4_linear_launch(x, *one, None, fmt, g, K, config=cfg)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                t = timed(cfg)
                rows.append(dict(format=name, N=N, K=K, cfg=cfg, us=t * 1e6, tbs=wbytes / t / 1e12, rel_err=err,
                                 old_us=t_old * 1e6, bf16_us=t16 * 1e6,
                                 is_table=all(cfg[k] == table.get(k, 1 if k == "DW" else False)
                                              for k in cfg if k != "kernel")))
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            t, cfg, err = best
            print(f"{name:<10}{N:>6}{K:>6} {t * 1e6:>8.1f}{wbytes / t / 1e12:>6.2f}{wbytes / t / 1e12 / HBM_TBS:>5.0%}"
                  f"{t_old * 1e6:>8.1f}{t_old / t:>6.2f}{t16 * 1e6:>8.1f}{t16 / t:>7.2f}  "
                  f"BLOCK_N={cfg['BLOCK_N']} warps={cfg['num_warps']} AHEAD={cfg['AHEAD']} HALF2={cfg['HALF2']} "
                  f"DW={cfg['DW']} CHAIN={cfg['CHAIN']} (rel err {err:.1e})", flush=True)
            for half2, dw, chain in ((False, 1, False), (True, 1, False), (True, 2, False), (True, 2, True)):
                mine = [r for r in rows if (r["format"], r["N"], r["K"], r["cfg"]["HALF2"], r["cfg"]["DW"],
                                            r["cfg"]["CHAIN"]) == (name, N, K, half2, dw, chain)]
                if not mine:
                    continue
                b = min(mine, key=lambda r: r["us"])
                print(f"    best with HALF2={half2} DW={dw} CHAIN={chain}: {b['us']:.1f} us, BLOCK_N={b['cfg']['BLOCK_N']} "
                      f"warps={b['cfg']['num_warps']} AHEAD={b['cfg']['AHEAD']} (rel err {b['rel_err']:.1e})", flush=True)
            del sets, one
    if args.options:
        print_option_totals(rows)
    write_rows(args.out, rows)
    return 0


def print_option_totals(rows: list) -> None:
    """Per format, each option's time summed over the shapes (one product of each a decoder
    layer, as a batch-1 step runs them) against the table tile's sum."""
    for name in dict.fromkeys(r["format"] for r in rows):
        mine = [r for r in rows if r["format"] == name]
        shapes = {(r["N"], r["K"]) for r in mine}
        table = sum(r["us"] for r in mine if r["is_table"])
        print(f"{name}: the table's tile {table:.1f} us over {len(shapes)} shapes; with each option:")
        for opts in OPTIONS[1:]:
            total = [r["us"] for r in mine if r["options"] == opts]
            if len(total) == len(shapes):
                print(f"    {sum(total):8.1f} us  {sum(total) / table - 1:+6.1%}  {opts}")


def time_options(rows, name, N, K, x, one, table, timed, ref, wbytes, t_old, t16) -> None:
    """The table's tile with each of OPTIONS at one shape: a row each, printed beside the tile as it is."""
    from atom.model_ops.kernels.w4_gemm import w4_linear_launch
    fmt, g, _ = FORMATS[name]
    base_us = None
    for opts in OPTIONS:
        cfg = dict(table, kernel="w4_gemv1", **opts)
        y = w4_linear_launch(x, *one, None, fmt, g, K, config=cfg)
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        t = timed(cfg)
        base_us = t * 1e6 if base_us is None else base_us
        rows.append(dict(format=name, N=N, K=K, cfg=cfg, options=opts, us=t * 1e6, tbs=wbytes / t / 1e12, rel_err=err,
                         old_us=t_old * 1e6, bf16_us=t16 * 1e6, is_table=not opts))
        print(f"{name:<10}{N:>6}{K:>6} {t * 1e6:>8.1f}{wbytes / t / 1e12:>6.2f}{wbytes / t / 1e12 / HBM_TBS:>5.0%}"
              f"{t_old * 1e6:>8.1f}{t_old / t:>6.2f}{t16 * 1e6:>8.1f}{t16 / t:>7.2f}  "
              f"table / this {base_us / (t * 1e6):.3f}  {opts or 'the table tile'} "
              f"(rel err {err:.1e})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
