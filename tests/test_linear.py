"""The CPU matmul route of the linear layers (`dense`) against `F.linear`."""
import pytest
import torch
import torch.nn.functional as F

from atom.model_ops.linear import Linear, MergedLinear, dense


@pytest.mark.parametrize("rows", [0, 1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    torch.testing.assert_close(dense(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_dense_keeps_leading_dims_and_other_dtypes():
    x, w = torch.randn(2, 3, 32), torch.randn(8, 32)
    assert dense(x, w).shape == (2, 3, 8)
    xb, wb = x.bfloat16(), w.bfloat16()  # not fp32: plain F.linear
    assert torch.equal(dense(xb, wb), F.linear(xb, wb))


def test_linear_layers_use_dense():
    lin = MergedLinear(32, [16, 16])
    lin.weight.data.normal_()
    x = torch.randn(5, 32)
    torch.testing.assert_close(lin(x), x @ lin.weight.T, rtol=1e-5, atol=1e-5)
    plain = Linear(32, 4, bias=True)
    plain.weight.data.normal_(); plain.bias.data.normal_()
    torch.testing.assert_close(plain(x), F.linear(x, plain.weight, plain.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gemv_choice_keeps_results(monkeypatch):
    """On a GPU: the per-shape choice is made, and whichever path a shape takes, dense() of
    one row matches F.linear; forcing the Triton GEMV for every shape matches too."""
    from atom.model_ops import linear
    layers = torch.nn.Sequential(*[MergedLinear(1024, [3072, 3072]) for _ in range(4)],
                                 *[Linear(3072, 1024) for _ in range(4)]).cuda().bfloat16()
    for m in layers:
        m.weight.data.normal_(std=0.02)
    monkeypatch.setattr(linear, "_GEMV_SHAPES", set())
    choices = linear.choose_gemv_shapes(layers)
    assert set(choices) == {(6144, 1024, torch.bfloat16), (1024, 3072, torch.bfloat16)}
    assert all(b > 0 and t > 0 for b, t in choices.values())
    for force in (False, True):
        if force:
            linear._GEMV_SHAPES.update(choices)
        for m in (layers[0], layers[4]):
            x = torch.randn(1, m.in_features, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(m(x), F.linear(x, m.weight), rtol=2e-2, atol=2e-2)
