"""The MoE layer's last step, `topk_sum`: each token's k expert rows added in fp32 and
rounded once, against the torch version, under the interpreter here and on a GPU."""
import pytest
import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON
from atom.model_ops.moe.topk_sum import topk_sum, topk_sum_ref

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # cpu: the Triton interpreter


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,k,H", [(1, 6, 2048), (5, 8, 96), (3, 4, 2880), (2, 1, 17)])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, None), (torch.float32, torch.bfloat16),
                                             (torch.float32, None)])
def test_topk_sum_matches_torch(device, T, k, H, dtype, out_dtype):
    g = torch.Generator().manual_seed(T * 100 + k)
    y = (torch.randn(T * k, H, generator=g) * 3).to(dtype).to(device)
    got = topk_sum(y, k, out_dtype)
    want = topk_sum_ref(y, k, out_dtype)
    assert got.shape == (T, H) and got.dtype == (out_dtype or dtype)
    # the same fp32 sum, one rounding: bit-equal for 16-bit outputs on a GPU; Triton's CPU
    # interpreter truncates to bf16 instead of rounding to nearest (up to one unit in the last place)
    if got.dtype == torch.bfloat16:
        ulp = 0 if device == "cuda" else 2 ** -7
        torch.testing.assert_close(got, want, rtol=ulp, atol=0)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    # a hand-made case: rows 1, 2, ... k of token t sum to t * k + k (k + 1) / 2 in every column
    ones = torch.arange(1, T * k + 1, dtype=torch.float32, device=device)[:, None].expand(T * k, H)
    s = topk_sum(ones.to(dtype).contiguous(), k, torch.float32)
    t = torch.arange(T, dtype=torch.float32, device=device)
    assert torch.equal(s[:, 0], t * k * k + k * (k + 1) / 2)


def test_topk_sum_refuses_rows_that_are_not_a_multiple_of_k():
    with pytest.raises(ValueError, match=r"topk_sum: y \(7, 4\) is not \[tokens \* top_k, hidden\] for top_k=2"):
        topk_sum(torch.zeros(7, 4), 2)


def test_topk_sum_of_no_tokens():
    assert topk_sum(torch.zeros(0, 8, dtype=torch.bfloat16), 6).shape == (0, 8)
