"""The instruction mix of the 4-bit decode GEMVs' inner loops (`w4_gemv1._w4_gemv1_kernel`, the
one at M = 1, and `w4_gemm._w4_gemv_kernel`, M = 2-4),
compiled for sm90 without a GPU (triton's ptxas and nvdisasm): how many SASS instructions one
loop step issues per weight, by opcode. The GEMV at batch 1 is bound by the CUDA cores' issue
rate rather than by bytes (the H200 issues 4 warp-instructions per SM per cycle: ~33 T
thread-instructions/s over 132 SMs at 1.98 GHz, against ~8.6 T 4-bit weights/s at 4.3 TB/s),
so fewer instructions per weight is the lever; this prints that count and the rate it allows.

    python scripts/w4_gemv_sass.py            # int4 g128 and MXFP4, both kernels (w4_gemv1: a reference tile)
    python scripts/w4_gemv_sass.py --dump d/  # also writes each kernel's SASS into d/
    python scripts/w4_gemv_sass.py --json     # one JSON line: instructions a weight per kernel and format
    python scripts/w4_gemv_sass.py --dot      # also w4_dot's loop (16 x 64 x 256 tile, both column orders)
    python scripts/w4_gemv_sass.py --loads    # also where each loop issues its loads, and what hides them
    python scripts/w4_gemv_sass.py --tables 128  # the tiles of Llama's products, as they are and at maxnreg 128

"prepared x": the loop reading x's word columns prepared by the kernel in front (XPACK,
`kernels.h2_xpack`) instead of scaling and packing them itself.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import re

ISSUE_RATE = 132 * 4 * 32 * 1.98e9  # thread-instructions per second, H200 (sm90)
SMS = 132  # H100 SXM and H200
#: the rows each table product's grid spans at Llama-3.1-8B's shapes (a gated product: its gate rows)
GRID_ROWS = {"o_proj": 4096, "gate-up": 28672, "down": 4096, "q/k/v+norm": 6144, "gate-up+silu": 14336,
             "q/k/v+rsq": 6144}


def with_defaults(kernel, const: dict) -> dict:
    """`const` plus the defaults of the kernel's other constexpr parameters (their values when
    a launch leaves them out), so that a new option of the kernel needs no edit here."""
    return {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **const}


def compile_gemv(fmt: str, group: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom.model_ops.kernels import w4_gemm as w4
    kernel = w4._w4_gemv_kernel
    tiles = dict(w4.GEMV_TILES)
    warps, stages = tiles.pop("num_warps"), tiles.pop("num_stages")
    const = dict(FMT=w4.FORMATS.index(fmt), GROUP=group, HAS_ZP=False, HAS_BIAS=False, PDL=True, BLOCK_M=1,
                 AHEAD=False, **tiles)
    scale = "*bf16" if fmt == "int4" else "*u8"
    types = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr=scale, z_ptr=scale, b_ptr="*bf16", y_ptr="*bf16")
    const = with_defaults(kernel, const)
    names = kernel.arg_names
    sig = {a: "constexpr" if a in const else types.get(a, "i32") for a in names}
    divisible = {"x_ptr", "w_ptr", "s_ptr", "y_ptr", "K", "n_words", "stride_xm", "stride_wn", "stride_sn",
                 "stride_ym"}  # what the launcher's pointers and strides are at the model shapes
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a in divisible}
    src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps,
                                                                                    num_stages=stages))
    weights_per_step = const["BLOCK_N"] * const["BLOCK_W"] * 8  # rows x words x nibbles
    return compiled, weights_per_step // (32 * warps)  # per thread


def compile_gemv1(fmt: str, group: int, half2: bool = False, dw: int = 1, chain: bool = False, xpack: bool = False,
                  l2d: int = 0, stages=None, tile: dict | None = None, k: int = 8192, maxnreg: int | None = None,
                  norm: bool = False, gated: bool = False, rsq: bool = False, epi_row: bool = False):
    """`w4_gemv1._w4_gemv1_kernel` for a 4096 x 8192 weight (rows of several steps at every
    reference tile: a row of one step has no words to load ahead), sm90, the reference tile below
    (dw: words a thread's load, the kernel's DW; xpack: x's columns prepared by the kernel in
    front, `h2_xpack`; l2d: L2 prefetches that many steps ahead; stages: the loads pipelined
    through shared memory instead of carried ahead); or `tile`, a tile of `w4_gemv1`'s tables
    (its BLOCK_N, BLOCK_W, warps and options) for k inputs, with the register cap `maxnreg`
    (Triton's launch option) and the norm inside (`norm`, the fused q/k/v launch), or gated
    after o_proj's epilogue (`gated`: SiLU-and-mul inside, 1 / rms from its sums, RSQ), or
    scaled by 1 / rms from the sums of the product in front (`rsq`: q/k/v after down's epilogue),
    or adding the residual and writing the next norm's row in its epilogue (`epi_row`: o_proj);
    (kernel, weights per thread a loop step; a gated step's weights are its gate and up rows')."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom.model_ops.kernels import w4_gemv1 as g1
    from atom.model_ops.kernels.w4_gemm import FORMATS
    kernel = g1._w4_gemv1_kernel
    # one reference tile for both formats: the table's up to 8192 outputs (8 rows over 8 warps,
    # the words ahead)
    tiles = dict(BLOCK_N=8, BLOCK_W=256, AHEAD=stages is None, HALF2=half2, DW=dw, CHAIN=chain, XPACK=xpack, L2D=l2d,
                 STAGES=stages)
    warps, stages = 8, 3
    if tile is not None:  # a table's tile: SPF is a prefetch before the loop, maxnreg a launch option
        tiles = {key: v for key, v in tile.items() if key not in ("num_warps", "num_stages", "maxnreg", "SPF")}
        warps, stages = tile["num_warps"], tile["num_stages"]
    dw = tiles.get("DW", 1)
    tiles.setdefault("FOLD", g1.fold_default(fmt))  # as the launcher
    n_scales = k // group
    const = dict(FMT=FORMATS.index(fmt), GROUP=group, HAS_ZP=False, HAS_BIAS=False, PDL=True, EVEN=True,
                 NORM=norm, HAS_RES=norm, GATED=gated, RSQ=gated or rsq, EPI_ROW=epi_row, SW=0, SS=0, SZ=0, **tiles)
    const.update(g1.stride_constants(fmt, bool(tiles.get("AHEAD")), k // 8, n_scales, n_scales))  # as the launcher
    scale = "*bf16" if fmt == "int4" else "*u8"
    types = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr=scale, z_ptr=scale, b_ptr="*bf16", y_ptr="*bf16", r_ptr="*bf16",
                 nw_ptr="*bf16", rout_ptr="*bf16", eps="fp32", xk_ptr="*i32", rsq_ptr="*fp32", er_ptr="*bf16",
                 erout_ptr="*bf16", enw_ptr="*bf16", ek_ptr="*bf16", esq_ptr="*fp32")
    const = with_defaults(kernel, const)
    names = kernel.arg_names
    sig = {a: "constexpr" if a in const else types.get(a, "i32") for a in names}
    # as the launch specializes them (16-byte aligned rows: the residual, norm weight and epilogue rows
    # load 8 columns at once); the weight and scale pointers are not specialized on alignment
    divisible = {"x_ptr", "y_ptr", "n_words", "xk_ptr", "r_ptr", "nw_ptr", "rout_ptr", "rsq_ptr", "er_ptr", "erout_ptr",
                 "enw_ptr", "ek_ptr", "esq_ptr"}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a in divisible}
    options = dict(num_warps=warps, num_stages=stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    return compiled, const["BLOCK_N"] * const["BLOCK_W"] * 8 * dw * (2 if gated else 1) // (32 * warps)


def compile_dot(fmt: str, order: int):
    """`w4_dot._w4_dot_kernel` for MXFP4 (or pair words) at the 16 x 64 x 256 tile, split-K
    partials, sm90, in column order `order` (the table's MXFP4 order is 0)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom.model_ops.kernels import w4_dot
    from atom.model_ops.kernels.w4_gemm import FORMATS
    kernel = w4_dot._w4_dot_kernel
    magic, magic_f = w4_dot.MAGIC2[torch.bfloat16]
    const = dict(FMT=FORMATS.index(fmt), GROUP=32, HAS_ZP=False, HAS_BIAS=True, PDL=True, DOT_F32=False,
                 MAGIC=magic, MAGIC_F=magic_f, ORDER=order, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256,
                 DK=w4_dot.dot_k(256, 32), PARTIAL=True)
    types = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", z_ptr="*u8", b_ptr="*bf16", y_ptr="*fp32")
    const = with_defaults(kernel, const)
    names = kernel.arg_names
    sig = {a: "constexpr" if a in const else types.get(a, "i32") for a in names}
    divisible = {"x_ptr", "w_ptr", "s_ptr", "z_ptr", "y_ptr", "stride_xm", "stride_wn", "stride_sn", "stride_zn",
                 "n_words", "K"}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a in divisible}
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def loop_body(sass: str) -> list[str]:
    """The instructions (control field and text) of the longest backward-branch loop of a SASS
    listing."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\.?(LBB\S+):", line.strip()))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.?(LBB[0-9_]+)", line)
        if m and labels.get(m.group(1), i) < i and (best is None or i - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], i)
    if best is None:
        raise RuntimeError("no loop found in the SASS")
    return [line.strip() for line in lines[best[0] + 1:best[1] + 1] if "\t" in line]


def loop_mix(sass: str) -> collections.Counter:
    """Opcodes of the longest backward-branch loop of a SASS listing."""
    body = [line.split("\t", 1)[1] for line in loop_body(sass)]
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in body)


def load_cover(sass: str) -> list[tuple[int, str, int]]:
    """Each global load of the loop: (its place in the loop, its opcode, how many instructions
    issue before the first that waits on its scoreboard, around the loop's back edge). The
    control field `wait:read:write:yield:stall` names the scoreboard a load sets (write) and
    the scoreboards an instruction waits for (a hex mask); ptxas has six and shares them, so a
    wait can cover loads issued far apart: the count is what hides the load's latency."""
    body = loop_body(sass)
    ctrl = [line.split("\t", 1)[0].split(":") for line in body]
    ops = [re.sub(r"^@!?U?P\w+\s+", "", line.split("\t", 1)[1]).split()[0] for line in body]
    out = []
    for i, op in enumerate(ops):
        if not op.startswith("LDG") or ctrl[i][2] == "-":
            continue
        bit = 1 << int(ctrl[i][2])
        for d in range(1, len(body) + 1):
            wait = ctrl[(i + d) % len(body)][0]
            if wait != "--" and int(wait, 16) & bit:
                break
        out.append((i, op, d - 1))
    return out


def registers(sass: str) -> int:
    """The registers a SASS listing uses: one more than the highest R it names (without a GPU
    the compiled kernel does not report its count)."""
    return 1 + max(int(r) for r in re.findall(r"\bR(\d+)\b", sass))


def table_tiles() -> list[tuple[str, str, int, dict, bool, bool, bool]]:
    """(name, format, K, tile, norm inside, gated, scaled by 1 / rms) of each tile `w4_gemv1`
    picks at Llama-3.1-8B's batch-1 products: o_proj (4096 x 4096, `TILES`), gate-up (28672 x
    4096, `TILES_WIDE`), down (4096 x 14336, `TILES_DEEP`), q/k/v with the norm inside (6144 x
    4096, `fused_tiles`), gate-up with SiLU-and-mul inside ("w4_gate_up_silu", `gated_tiles`)
    and q/k/v after down's epilogue ("w4_down_add_norm": `tiles`, RSQ), for int4 and
    MXFP4 pair words."""
    from atom.model_ops.kernels import w4_gemv1 as g1
    out = []
    for fmt in ("int4", "mxfp4_pairs"):
        out += [("o_proj", fmt, 4096, g1.tiles(4096, fmt, 4096), False, False, False),
                ("gate-up", fmt, 4096, g1.tiles(28672, fmt, 4096), False, False, False),
                ("down", fmt, 14336, g1.tiles(4096, fmt, 14336), False, False, False),
                ("q/k/v+norm", fmt, 4096, g1.fused_tiles(False), True, False, False),
                ("gate-up+silu", fmt, 4096, g1.gated_tiles(28672, fmt, 4096), False, True, False),
                ("q/k/v+rsq", fmt, 4096, g1.tiles(6144, fmt, 4096), False, False, True)]
    return out


def programs_per_sm(regs: int, warps: int) -> int:
    """How many programs of `warps` warps an sm90 SM holds by registers (65,536, a thread's count
    allocated in steps of 8) and its limits of 64 warps and 32 programs; shared memory aside
    (the one-row GEMV's tiles use little)."""
    per_program = -(-regs // 8) * 8 * 32 * warps
    return min(65536 // per_program, 64 // warps, 32)


def waves(programs: int, regs: int, warps: int, sms: int = SMS) -> float:
    """Programs over the programs all SMs hold at once (`programs_per_sm`): above 1 the grid
    runs in more than one wave, its last partly full."""
    return programs / (sms * programs_per_sm(regs, warps))


def print_tables(caps: list[int]) -> None:
    """For each tile of `table_tiles`, under its own register cap and each of `caps`: the
    registers, the loop's instructions a step, and per load opcode the range of instructions
    issued before the first wait on it (`load_cover`), and the programs an SM and waves of the
    product's grid at Llama-3.1-8B's shape (`waves`)."""
    from triton.tools.disasm import get_sass
    for name, fmt, k, tile, norm, gated, rsq in table_tiles():
        group = 128 if fmt == "int4" else 32
        for cap in dict.fromkeys([tile.get("maxnreg")] + caps):
            compiled, _ = compile_gemv1(fmt, group, tile=tile, k=k, maxnreg=cap, norm=norm, gated=gated, rsq=rsq)
            sass = get_sass(compiled.asm["cubin"])
            spans = collections.defaultdict(list)
            for _, op, cover in load_cover(sass):
                spans[op].append(cover)
            loads = ", ".join(f"{op} x{len(c)} {min(c)}-{max(c)}" for op, c in sorted(spans.items()))
            regs, warps = registers(sass), tile["num_warps"]
            programs = GRID_ROWS[name] // tile["BLOCK_N"]
            print(f"{name} {fmt} maxnreg={cap}: {regs} registers, {len(loop_body(sass))} instructions "
                  f"a step; {programs_per_sm(regs, warps)} programs an SM, {waves(programs, regs, warps):.2f} waves "
                  f"of {programs}; cover {loads}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", help="write each kernel's SASS into this folder")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    ap.add_argument("--dot", action="store_true", help="also w4_dot's loop, MXFP4 and pair words")
    ap.add_argument("--tables", nargs="*", type=int, metavar="CAP",
                    help="only the tiles w4_gemv1 picks at Llama-3.1-8B's products, under their register cap and "
                         "each CAP (maxnreg): registers, instructions a step, the loads' cover")
    ap.add_argument("--loads", action="store_true",
                    help="also each loop's global loads: place, and instructions issued before the first wait on them")
    args = ap.parse_args()
    if args.tables is not None:
        return print_tables(args.tables)
    from triton.tools.disasm import get_sass
    result = {}
    half2 = functools.partial(compile_gemv1, half2=True)
    pairs = functools.partial(compile_gemv1, half2=True, dw=2)
    chain = functools.partial(compile_gemv1, half2=True, dw=2, chain=True)
    prepared = functools.partial(compile_gemv1, half2=True, xpack=True)
    prepared2 = functools.partial(compile_gemv1, half2=True, dw=2, xpack=True)
    l2d = functools.partial(compile_gemv1, half2=True, l2d=2)
    l2d_pairs = functools.partial(compile_gemv1, half2=True, dw=2, l2d=2)
    staged = functools.partial(compile_gemv1, half2=True, stages=3)
    staged_pairs = functools.partial(compile_gemv1, half2=True, dw=2, stages=3)
    for name, compile_fn, fmt, group in (("w4_gemv1", compile_gemv1, "int4", 128),
                                         ("w4_gemv1 HALF2", half2, "int4", 128),
                                         ("w4_gemv1 HALF2", half2, "mxfp4", 32),
                                         ("w4_gemv1 HALF2 DW2", pairs, "int4", 128),
                                         ("w4_gemv1 HALF2 DW2", pairs, "mxfp4", 32),
                                         ("w4_gemv1 HALF2 DW2", pairs, "mxfp4_pairs", 32),
                                         ("w4_gemv1 HALF2 DW2 CHAIN", chain, "int4", 128),
                                         ("w4_gemv1 HALF2 DW2 CHAIN", chain, "mxfp4", 32),
                                         ("w4_gemv1 HALF2 DW2 CHAIN", chain, "mxfp4_pairs", 32),
                                         ("w4_gemv1 HALF2 prepared x", prepared, "int4", 128),
                                         ("w4_gemv1 HALF2 DW2 prepared x", prepared2, "int4", 128),
                                         ("w4_gemv1 HALF2 DW2 prepared x", prepared2, "mxfp4", 32),
                                         ("w4_gemv1 HALF2 DW2 prepared x", prepared2, "mxfp4_pairs", 32),
                                         ("w4_gemv1 HALF2 L2D2", l2d, "int4", 128),
                                         ("w4_gemv1 HALF2 DW2 L2D2", l2d_pairs, "mxfp4", 32),
                                         ("w4_gemv1 HALF2 STAGES3", staged, "int4", 128),
                                         ("w4_gemv1 HALF2 DW2 STAGES3", staged_pairs, "mxfp4", 32),
                                         ("w4_gemv1", compile_gemv1, "mxfp4", 32),
                                         ("w4_gemv", compile_gemv, "int4", 128), ("w4_gemv", compile_gemv, "mxfp4", 32),
                                         ("w4_gemv", compile_gemv, "mxfp4_pairs", 32)):
        compiled, per_thread = compile_fn(fmt, group)
        sass = get_sass(compiled.asm["cubin"])
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"{name}_{fmt}.sass"), "w") as f:
                f.write(sass)
        mix = loop_mix(sass)
        total = sum(mix.values())
        per_weight = total / per_thread
        tbs = ISSUE_RATE / per_weight * 0.5 / 1e12  # 0.5 byte a weight
        top = ", ".join(f"{op} {n}" for op, n in mix.most_common(8))
        result[f"{name} {fmt}"] = round(per_weight, 3)
        if args.json:
            continue
        print(f"{name} {fmt} g{group}: {total} instructions a loop step for {per_thread} weights a thread = "
              f"{per_weight:.2f} a weight -> at most {tbs:.2f} TB/s of packed weights at full issue rate ({top})")
        if args.loads:
            print("    loads (place: opcode, instructions before the first wait on them): "
                  + ", ".join(f"{i}: {op} {cover}" for i, op, cover in load_cover(sass)))
    for fmt in ("mxfp4", "mxfp4_pairs") if args.dot else ():
        for order in (0, 1):
            mix = loop_mix(get_sass(compile_dot(fmt, order).asm["cubin"]))
            result[f"w4_dot {fmt} order {order}"] = sum(mix.values())
            if not args.json:
                print(f"w4_dot {fmt} ORDER={order}: {sum(mix.values())} instructions a loop step "
                      f"({', '.join(f'{op} {n}' for op, n in mix.most_common(6))})")
    if args.json:
        import json
        print(json.dumps(result))


if __name__ == "__main__":
    main()
