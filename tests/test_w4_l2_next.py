"""The kernel plan's "w4_l2_next": at one row, the q/k/v GEMV with the norm inside asks L2 for
o_proj's words and gate-up's first bytes after its loop (`w4_gemv1`'s L2N, one bulk prefetch a
warp), and the later products for the next one's weights as `fusions.L2_NEXT_BYTES` says. A
hint: the products' bits do not change. The prefetch is sm90 PTX, so the CPU cases check the
chunks, the plan and the plumbing; the sm90 compile is in `test_kernel_compile.py`, the GPU
engine case in `test_h2_xpack.py`."""
import pytest
import torch

from test_triton_kernels import CPU, GPU  # noqa: E402  (sets TRITON_INTERPRET)

from atom.model_ops.kernels import w4_gemv1 as g1  # noqa: E402
from atom.tuning import fusions  # noqa: E402
from atom.tuning.fusions import default_fusions  # noqa: E402
from atom.tuning.plan import KernelPlan  # noqa: E402


#: the kernel's L2N arguments (`w4_gemv1.l2_next_args`)
L2N_KW = ("L2N", "l2a_ptr", "l2a_count", "l2a_chunk", "l2b_ptr", "l2b_count", "l2b_chunk")


def _record_launches(monkeypatch) -> list[dict]:
    """The keyword arguments of each `_w4_gemv1_kernel` launch from here on (the launcher's
    kernel replaced by one that notes them and launches as before)."""
    kwargs, real = [], g1._w4_gemv1_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: kwargs.append(kw) or real[grid](*a, **kw)

    monkeypatch.setattr(g1, "_w4_gemv1_kernel", Spy())
    return kwargs


def _chunks(args: dict, name: str, programs: int, warps: int, size: int) -> list[tuple[int, int]]:
    """(start byte, bytes) of every warp's prefetch, as `_bulk_prefetch_l2` forms them."""
    count, chunk = args[f"{name}_count"], args[f"{name}_chunk"]
    out = []
    for t in range(programs * warps):
        start = t * chunk
        n = min(max(count - start, 0), chunk)
        if n > 0:
            out.append((start * size, n * size))
    return out


@pytest.mark.parametrize("numel,dtype,nbytes,programs,warps", [
    (4096 * 512, torch.int32, None, 768, 4),        # Llama's o_proj words, all of them, from q/k/v's grid
    (28672 * 512, torch.int32, 16 << 20, 768, 4),   # gate-up's first 16 MiB
    (28672 * 2048, torch.uint8, 16 << 20, 768, 4),  # MXFP4 bytes
    (100, torch.int32, None, 3, 4),                 # fewer bytes than warps x 16
    (37, torch.uint8, None, 2, 1),                  # a tail under 16 bytes is left out
])
def test_chunks_cover_the_region_once_in_16_byte_pieces(numel, dtype, nbytes, programs, warps):
    t = torch.zeros(numel, dtype=dtype)
    total = numel * t.element_size()
    want = min(total if nbytes is None else nbytes, total) // 16 * 16
    args = g1.l2_next_args([(t, total if nbytes is None else nbytes)], programs, warps)
    assert args["L2N"] == 1 and args["l2a_ptr"] is t
    pieces = _chunks(args, "l2a", programs, warps, t.element_size())
    assert all(s % 16 == 0 and n % 16 == 0 and n > 0 for s, n in pieces)
    assert [s for s, _ in pieces] == sorted(s for s, _ in pieces)
    assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))  # no gap, no overlap
    assert pieces[0][0] == 0 and sum(n for _, n in pieces) == want


def test_regions_left_out_and_their_order():
    """Empty, unaligned or strided regions are left out (the one left goes first); no region
    gives no arguments; more than two is an error naming the count."""
    a, b = torch.zeros(4096, dtype=torch.int32), torch.zeros(8192, dtype=torch.uint8)
    both = g1.l2_next_args([(a, 1 << 20), (b, 4096)], 4, 32)
    assert both["L2N"] == 2 and both["l2a_ptr"] is a and both["l2b_ptr"] is b
    assert both["l2a_count"] == 4096 and both["l2b_count"] == 4096
    unaligned = torch.zeros(64, dtype=torch.uint8)[1:33]
    one = g1.l2_next_args([(unaligned, 32), (b, 4096)], 4, 32)
    assert one["L2N"] == 1 and one["l2a_ptr"] is b and "l2b_ptr" not in one
    assert g1.l2_next_args([(torch.zeros(0, dtype=torch.int32), 16)], 4, 32) == {}
    assert g1.l2_next_args([(a[::2], 1024)], 4, 32) == {}
    assert g1.l2_next_args([(b, 8)], 4, 32) == {}  # under 16 bytes
    with pytest.raises(ValueError, match="at most 2 regions, got 3"):
        g1.l2_next_args([(a, 16), (b, 16), (a, 16)], 4, 32)
    assert set(both) <= set(L2N_KW) <= set(g1._w4_gemv1_kernel.arg_names)


def test_plan_needs_the_qkv_norm_gemv_and_the_o_proj_path():
    with pytest.raises(ValueError, match="needs 'w4_norm_gemv' and 'w4_o_proj_add_norm' too"):
        KernelPlan(backend="triton", fusions=("w4_l2_next",))
    with pytest.raises(ValueError, match="needs 'w4_norm_gemv' and 'w4_o_proj_add_norm' too"):
        KernelPlan(backend="triton", fusions=("w4_norm_gemv", "w4_l2_next"))
    plan = KernelPlan(backend="triton", fusions=default_fusions("triton") + ("w4_l2_next",))
    assert plan.has("w4_l2_next") and not KernelPlan(backend="triton", fusions=default_fusions("triton")).has(
        "w4_l2_next")


@pytest.mark.parametrize("device", [CPU])
def test_regions_of_a_4bit_layer(device, monkeypatch):
    """o_proj's words whole and gate-up's first `L2_NEXT_BYTES["gate_up_from_qkv"]` bytes, for one 16-bit row
    of a layer whose o_proj and gate-up are 4-bit; nothing without the fusion, for two rows, or
    with a bias on o_proj."""
    from test_w4_down_add_norm import _two_layers
    layer, _ = _two_layers("int4_g32_sym", monkeypatch)
    row = torch.randn(1, 128).to(torch.bfloat16)
    plan = KernelPlan(backend="triton", fusions=default_fusions("triton") + ("w4_l2_next",))
    (o, o_bytes), (gate_up, gate_up_bytes) = fusions.w4_l2_next_regions(layer, plan, row)
    for lin, words in ((layer.self_attn.o_proj, o), (layer.mlp.gate_up_proj, gate_up)):
        packed = lin.method.one_row_operands(lin)[0]
        assert words.data_ptr() == packed.data_ptr() and words.numel() == packed.numel()  # all the words, flat
    assert o_bytes == o.numel() * o.element_size() and gate_up_bytes == fusions.L2_NEXT_BYTES["gate_up_from_qkv"]
    assert fusions.w4_l2_next_regions(layer, KernelPlan(backend="triton", fusions=default_fusions("triton")),
                                      row) == ()
    assert fusions.w4_l2_next_regions(layer, plan, torch.randn(2, 128).to(torch.bfloat16)) == ()
    layer.self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(128))
    assert fusions.w4_l2_next_regions(layer, plan, row) == ()


@pytest.mark.parametrize("device", [CPU])
def test_the_later_stages_regions(device, monkeypatch):
    """With every stage of `L2_NEXT_BYTES` on: o_proj asks for gate-up's bytes after the q/k/v
    GEMV's, gate-up for down's first, down for the next layer's q/k/v words (only where
    `install` linked the layer to a next one); a stage of 0 bytes or past the words asks for
    nothing."""
    from test_w4_down_add_norm import _two_layers
    first, second = _two_layers("int4_g32_sym", monkeypatch)
    monkeypatch.setattr(fusions, "L2_NEXT_BYTES", dict(gate_up_from_qkv=4096, gate_up_from_o_proj=1 << 20,
                                                       down_from_gate_up=2048, qkv_from_down=0))
    plan = KernelPlan(backend="triton", fusions=default_fusions("triton") + ("w4_l2_next",))
    act = torch.randn(1, 2048).to(torch.bfloat16)
    words = {name: lin.method.one_row_operands(lin)[0] for name, lin in (
        ("gate_up", first.mlp.gate_up_proj), ("down", first.mlp.down_proj), ("qkv", second.self_attn.qkv_proj))}
    got = fusions.w4_l2_next_mlp(first, plan, words["gate_up"], act)
    (gu, gu_bytes), = got["o_proj"]
    assert gu.data_ptr() == words["gate_up"].data_ptr() + 4096 and gu_bytes == 1 << 20
    assert gu.numel() * gu.element_size() == words["gate_up"].numel() * words["gate_up"].element_size() - 4096
    (dn, dn_bytes), = got["gate_up"]
    assert dn.data_ptr() == words["down"].data_ptr() and dn_bytes == 2048
    assert got["down"] == ()  # no next layer linked
    first.__dict__["next_layer"] = second
    fusions.L2_NEXT_BYTES["qkv_from_down"] = 512
    (qkv, qkv_bytes), = fusions.w4_l2_next_mlp(first, plan, words["gate_up"], act)["down"]
    assert qkv.data_ptr() == words["qkv"].data_ptr() and qkv_bytes == 512
    fusions.L2_NEXT_BYTES["gate_up_from_qkv"] = 1 << 30  # past gate-up's words: o_proj asks for nothing
    assert fusions.w4_l2_next_mlp(first, plan, words["gate_up"], act)["o_proj"] == ()
    assert fusions.w4_l2_next_mlp(first, KernelPlan(backend="triton", fusions=default_fusions("triton")),
                                  words["gate_up"], act) == {}


@pytest.mark.parametrize("device", [CPU])
def test_mlp_with_every_stage_gives_the_same_bits_off_sm90(device, monkeypatch):
    """o_proj + MLP of one row, then the next layer's q/k/v (`test_w4_down_add_norm._run`) with
    every stage on: the same bits and launches as without the fusion under the interpreter,
    down through its one-row GEMV directly (where it asks for the next q/k/v's words)."""
    from test_w4_down_add_norm import _run, _two_layers
    first, second = _two_layers("int4_g32_sym", monkeypatch)
    first.__dict__["next_layer"] = second
    monkeypatch.setattr(fusions, "L2_NEXT_BYTES", dict.fromkeys(fusions.L2_NEXT_BYTES, 1 << 20))
    g = torch.Generator().manual_seed(2)
    a, res = torch.randn(1, 2048, generator=g).to(torch.bfloat16), torch.randn(1, 128, generator=g).to(torch.bfloat16)
    base = default_fusions("triton")
    want = _run(first, second, KernelPlan(backend="triton", fusions=base, force_kernels=True), a, res)
    got = _run(first, second, KernelPlan(backend="triton", fusions=base + ("w4_l2_next",), force_kernels=True), a, res)
    for w, g_ in zip(want[:3], got[:3]):
        assert torch.equal(w, g_)
    assert got[3].to_dict() == want[3].to_dict()


@pytest.mark.parametrize("device", [CPU])
def test_qkv_with_regions_gives_the_same_bits_off_sm90(device, monkeypatch):
    """Under the interpreter (no sm90 PTX) the launcher drops L2N: the q/k/v GEMV with the norm
    inside gives the same bits with the regions as without, and its launch carries none of the
    prefetch's arguments."""
    from test_w4_down_add_norm import _two_layers
    layer, nxt = _two_layers("int4_g32_sym", monkeypatch)
    plan = KernelPlan(backend="triton", fusions=default_fusions("triton") + ("w4_l2_next",), force_kernels=True)
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
        lin.plan = plan
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(1, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    kernel_kwargs = _record_launches(monkeypatch)
    regions = fusions.w4_l2_next_regions(layer, plan, x)
    assert len(regions) == 2
    got = fusions.norm_linear(layer.input_layernorm, layer.self_attn.qkv_proj, x, res, l2_next=regions)
    want = fusions.norm_linear(layer.input_layernorm, layer.self_attn.qkv_proj, x, res)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(kernel_kwargs) == 2 and not any(k in kw for kw in kernel_kwargs for k in L2N_KW)


@pytest.mark.parametrize("device", [CPU])
def test_row_parallel_products_under_tp_keep_their_forward(device, monkeypatch):
    """Under tensor parallel a row-parallel 4-bit layer (o_proj, down) sums its partial products
    over the ranks in its forward: the fused paths, which launch the product themselves, leave
    it to that forward (no operands), so o_proj's epilogue path, down's and this fusion's MLP
    stages do not apply; column-parallel q/k/v and gate-up keep theirs."""
    import types
    from test_w4_down_add_norm import _two_layers
    first, second = _two_layers("int4_g32_sym", monkeypatch)
    first.__dict__["next_layer"] = second
    plan = KernelPlan(backend="triton", fusions=default_fusions("triton") + ("w4_l2_next", "w4_down_add_norm"))
    row, act = torch.randn(1, 128).to(torch.bfloat16), torch.randn(1, 192).to(torch.bfloat16)
    assert fusions.w4_o_proj_add_norm_operands(first, plan, row) is not None
    assert fusions.w4_down_add_norm_operands(first, plan, act) is not None
    tp2 = types.SimpleNamespace(world_size=2, rank=0)
    for lin in (first.self_attn.o_proj, first.mlp.down_proj):
        monkeypatch.setattr(lin, "tp", tp2)
    assert fusions.w4_o_proj_add_norm_operands(first, plan, row) is None
    assert fusions.w4_down_add_norm_operands(first, plan, act) is None
    gate_up_words = first.mlp.gate_up_proj.method.one_row_operands(first.mlp.gate_up_proj)[0]
    assert fusions.w4_l2_next_regions(first, plan, row) == ()
    assert fusions.w4_l2_next_mlp(first, plan, gate_up_words, act) == {}
    assert fusions.w4_one_row(plan, first.self_attn.qkv_proj, row, False) is not None
    monkeypatch.setattr(first.mlp.down_proj, "reduce_results", False)  # the caller sums: the operands again
    assert fusions.w4_down_add_norm_operands(first, plan, act) is not None


@pytest.mark.parametrize("device", [GPU])
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("mxfp4_pairs", 32)])
def test_gpu_qkv_asking_l2_for_the_next_weights_changes_no_bit(device, fmt, group, monkeypatch):
    """Llama-3.1-8B's q/k/v with the norm inside (6144 x 4096) asking L2 for o_proj's words
    (4096 x 4096) and 16 MiB of gate-up's (28672 x 4096): the launch carries both regions
    (L2N = 2), and the same y and residual bits come out as without, twice (the second with the
    lines already in L2)."""
    from test_h2_xpack import _w4_layer
    qkv, o, gate_up = (_w4_layer(fmt, n, 4096, group, device, seed) for seed, n in enumerate((6144, 4096, 28672)))
    x, res = (torch.randn(1, 4096, device=device).to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(4096, device=device) + 0.5).to(torch.bfloat16)
    want = g1.w4_gemv1_fused(x, res, w, 1e-5, *qkv, fmt, group, 4096)
    regions = ((o[0], o[0].numel() * o[0].element_size()), (gate_up[0], 16 << 20))
    kernel_kwargs = _record_launches(monkeypatch)
    for _ in range(2):
        got = g1.w4_gemv1_fused(x, res, w, 1e-5, *qkv, fmt, group, 4096, l2_next=regions)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert [kw.get("L2N") for kw in kernel_kwargs] == [2, 2]
    assert kernel_kwargs[0]["l2a_count"] * o[0].element_size() == o[0].numel() * o[0].element_size()


@pytest.mark.parametrize("device", [GPU])
@pytest.mark.parametrize("fmt", ["w4a16", "mxfp4_w4a16"])
def test_gpu_engine_with_every_stage_keeps_the_tokens(device, fmt, tmp_path, monkeypatch):
    """A 4-bit dummy Llama (CUDA graphs) with "w4_l2_next" and every stage of `L2_NEXT_BYTES` on,
    down asking for the next layer's q/k/v words: each greedy token among the best of an engine
    without the fusion, teacher-forced (`test_h2_xpack.test_gpu_engine_with_prepared_rows`'s
    check; two engines may pick other bf16 kernels at start-up, so not bit for bit)."""
    from test_h2_xpack import test_gpu_engine_with_prepared_rows
    monkeypatch.setattr(fusions, "L2_NEXT_BYTES", dict.fromkeys(fusions.L2_NEXT_BYTES, 1 << 20))
    test_gpu_engine_with_prepared_rows(device, fmt, ("w4_l2_next",), tmp_path, monkeypatch)
