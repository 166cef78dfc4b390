"""Whether the int8 fused quantizers (add + RMSNorm + quantize, SiLU-and-mul + quantize) give the
separate kernels' bits above int8's row limit (`fusions.FUSED_QUANT_MAX_ROWS`), at Llama-3.1-8B's
widths: a GPU probe for raising that limit, printed, nothing written.

    PYTHONPATH=$PWD python3 scripts/int8_fused_bits.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_act_quant_fused import _rows, _separate_norm  # noqa: E402
from atom.model_ops.activation import silu_and_mul  # noqa: E402
from atom.model_ops.kernels.act_quant import act_quant  # noqa: E402
from atom.model_ops.kernels.act_quant_fused import norm_quant, silu_quant  # noqa: E402


def main() -> None:
    H, I = 4096, 14336
    for M in (64, 128, 300, 2048):
        x, r = _rows(M, H, torch.bfloat16), _rows(M, H, torch.bfloat16, seed=1)
        w = (torch.rand(H, device="cuda") + 0.5).to(torch.bfloat16)
        out = []
        for res in (r, None):
            got, want = norm_quant(x, res, w, 1e-5, "int8", 127.0), _separate_norm(x, res, w, 1e-5, "int8", 127.0)
            out.append(all(torch.equal(g, v) for g, v in zip(got, want)))
        y = _rows(M, 2 * I, torch.bfloat16, scale=2.0)
        got, want = silu_quant(y, "int8", 127.0), act_quant(silu_and_mul(y), "int8", I, 127.0)
        out.append(all(torch.equal(g, v) for g, v in zip(got, want)))
        print(f"int8 rows {M}: norm+quant (residual, none) / silu+quant same bits: {out}", flush=True)


if __name__ == "__main__":
    main()
