"""The MoE layer's last step, `topk_sum`: each token's k expert rows added in fp32 in order
and rounded once, against that sum written out here and against torch's `sum`, under the
interpreter on a CPU and (marked `gpu`) on a GPU."""
import pytest
import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON
from atom.model_ops.moe.topk_sum import topk_sum, topk_sum_ref

# cpu: the Triton interpreter (tests/conftest.py sets it where there is no GPU)
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else ["cpu"]


def sequential_sum(y: torch.Tensor, k: int, out_dtype) -> torch.Tensor:
    rows = y.float().view(-1, k, y.shape[1])
    acc = rows[:, 0].clone()
    for j in range(1, k):
        acc += rows[:, j]
    return acc.to(out_dtype)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,k,H", [(1, 6, 2048), (5, 8, 96), (3, 4, 2880), (2, 1, 17)])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, None), (torch.float32, torch.bfloat16),
                                             (torch.float32, None)])
def test_topk_sum_matches_torch(device, T, k, H, dtype, out_dtype):
    g = torch.Generator().manual_seed(T * 100 + k)
    y = (torch.randn(T * k, H, generator=g) * 3).to(dtype).to(device)
    got = topk_sum(y, k, out_dtype)
    assert got.shape == (T, H) and got.dtype == (out_dtype or dtype)
    # the same fp32 additions in the same order, one rounding: bit-equal on a GPU; Triton's CPU
    # interpreter truncates to bf16 instead of rounding to nearest (one unit in the last place)
    exact = sequential_sum(y, k, got.dtype)
    ulp = 2 ** -7 if got.dtype == torch.bfloat16 and device == "cpu" else 0
    torch.testing.assert_close(got, exact, rtol=ulp, atol=0)
    # torch's sum adds in its own order: within a unit in the last place of the output
    tol = 2 ** -7 if got.dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got, topk_sum_ref(y, k, out_dtype), rtol=tol, atol=1e-5)
    # a hand-made case: rows 1, 2, ... k of token t sum to t * k * k + k (k + 1) / 2 in every column
    ones = torch.arange(1, T * k + 1, dtype=torch.float32, device=device)[:, None].expand(T * k, H)
    s = topk_sum(ones.to(dtype).contiguous(), k, torch.float32)
    t = torch.arange(T, dtype=torch.float32, device=device)
    assert torch.equal(s[:, 0], t * k * k + k * (k + 1) / 2)


def test_topk_sum_refuses_rows_that_are_not_a_multiple_of_k():
    with pytest.raises(ValueError, match=r"topk_sum: y \(7, 4\) is not \[tokens \* top_k, hidden\] for top_k=2"):
        topk_sum(torch.zeros(7, 4), 2)


def test_topk_sum_of_no_tokens():
    assert topk_sum(torch.zeros(0, 8, dtype=torch.bfloat16), 6).shape == (0, 8)
