"""Times the quantized linear methods' GPU paths against the bf16 F.linear at the
Llama-3.1-8B linear shapes and prints the bytes each moves per second beside the H200's
~4.3 TB/s HBM limit; writes every figure as JSON to --out.

    python scripts/quant_kernel_bench.py --out quant_kernels.json [--formats ptpc_fp8 ...]

Each format is a layer built through the public API (`atom.model_ops.linear.Linear` with a
`LayerQuantConfig`, random weights in the format's layout, `process_weights_after_loading`)
and timed as `layer(x)`: activation quantization, the kernel and the scales, as the engine
runs them. Times are CUDA-graph replays of `--reps` calls (launch overhead out, as in the
engine's decode graphs), the median of `--trials`. The JSON rows also carry the layer's
`kernel` report, the route taken for that M and the largest error against the method's
torch reference (its CPU product on the same layer, run on the GPU tensors).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

HBM_LIMIT_GBS = 4300.0
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
MS = [1, 8, 64, 512]


def specs():
    from atom.quant_spec import LayerQuantConfig, QuantType
    fp8 = torch.float8_e4m3fn
    return {
        "ptpc_fp8": LayerQuantConfig(QuantType.per_Token, fp8, True, "quark", act_scheme="token"),
        "fp8_per_tensor": LayerQuantConfig(QuantType.per_Tensor, fp8, True, "fp8"),
        "fp8_block": LayerQuantConfig(QuantType.per_1x128, fp8, True, "fp8", block_size=(128, 128),
                                      act_scheme="group", act_group_size=128),
        "int8_w8a8": LayerQuantConfig(QuantType.per_Token, torch.int8, True, "compressed-tensors",
                                      act_scheme="token", symmetric=True),
    }


class _OneSpec:
    def __init__(self, spec):
        self.spec = spec

    def get_layer_quant_config(self, prefix):
        return self.spec


def make_layer(spec, N: int, K: int):
    """A Linear of the format on the GPU with random weights and scales in its layout."""
    from atom.model_ops.linear import Linear
    with torch.device("cuda"):
        layer = Linear(K, N, quant_config=_OneSpec(spec), prefix="bench.proj")
    with torch.no_grad():
        for name, p in layer.named_parameters(recurse=False):
            if name == "weight":
                if p.dtype == torch.int8:
                    p.copy_(torch.randint(-127, 128, p.shape, dtype=torch.int8, device="cuda"))
                else:
                    p.copy_((torch.randn(p.shape, device="cuda") * 64).clamp(-448, 448).to(p.dtype))
            elif p.dtype.is_floating_point:
                p.copy_(torch.rand(p.shape, device="cuda") * 1e-3 + 1e-4)
    layer.method.process_weights_after_loading(layer)
    return layer


def time_us(fn, reps: int, trials: int) -> float:
    """Median over `trials` of the per-call time of `reps` calls replayed from a CUDA graph
    (a plain loop where capture fails)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception as e:  # noqa: BLE001 - report and time without a graph
        print(f"  (no CUDA graph: {type(e).__name__}: {e})", file=sys.stderr)
        graph = None
    out = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(reps):
                fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for the figures")
    ap.add_argument("--formats", nargs="*", default=None, help=f"subset of {list(specs())}")
    ap.add_argument("--m", nargs="*", type=int, default=MS, help="rows (tokens) per product")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--trials", type=int, default=7)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("quant_kernel_bench: no CUDA GPU here; this benchmark times GPU kernels (run it on the H200)",
              file=sys.stderr)
        return 2
    from atom.model_ops.quant import common
    all_specs = specs()
    unknown = set(args.formats or ()) - set(all_specs)
    if unknown:
        ap.error(f"--formats {sorted(unknown)}: allowed {list(all_specs)}")
    chosen = {k: all_specs[k] for k in (args.formats or all_specs)}
    torch.manual_seed(0)
    rows = []
    print(f"{'format':<15} {'N':>6} {'K':>6} {'M':>4} {'bf16 us':>9} {'quant us':>9} {'speedup':>8} "
          f"{'bf16 GB/s':>10} {'quant GB/s':>10}  (HBM limit {HBM_LIMIT_GBS:.0f} GB/s)  route")
    for N, K in SHAPES:
        w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        layers = {name: make_layer(spec, N, K) for name, spec in chosen.items()}
        for M in args.m:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            io_bytes = (M * K + M * N) * 2
            t16 = time_us(lambda: F.linear(x, w16), args.reps, args.trials)
            gbs16 = (N * K * 2 + io_bytes) / t16 / 1e3
            for name, layer in layers.items():
                tq = time_us(lambda: layer(x), args.reps, args.trials)
                qbytes = layer.method.weight_bytes(layer) + io_bytes
                gbsq = qbytes / tq / 1e3
                y = layer(x)
                with torch.no_grad():  # the method's torch reference on the same tensors
                    use = common.use_kernels
                    common.use_kernels = lambda t: False
                    try:
                        ref = layer(x)
                    finally:
                        common.use_kernels = use
                err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()
                route = common.product_route("int8" if "int8" in name else "fp8", M, x, N,
                                             block_k=128 if name == "fp8_block" else 0,
                                             rowwise=getattr(layer, "w_scalar", None) is None)
                print(f"{name:<15} {N:>6} {K:>6} {M:>4} {t16:>9.2f} {tq:>9.2f} {t16 / tq:>7.2f}x "
                      f"{gbs16:>10.0f} {gbsq:>10.0f}  {route}  (max rel err {err:.1e})")
                rows.append(dict(format=name, N=N, K=K, M=M, bf16_us=t16, quant_us=tq, speedup=t16 / tq,
                                 bf16_gbs=gbs16, quant_gbs=gbsq, hbm_limit_gbs=HBM_LIMIT_GBS, route=route,
                                 kernel=layer.method.kernel, format_spec=layer.method.format(layer),
                                 max_rel_err=err))
        del layers
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
