"""The experts kernels against a dense per-token torch computation: the torch reference and
the Triton grouped GEMM (sorted and unsorted paths, under TRITON_INTERPRET=1 on a CPU), the
align step, the small-batch rule, tile files and their selection, the tuning command's search."""
import json

import pytest
import torch
import torch.nn.functional as F

from atom.model_ops.activation import silu_and_mul_ref
from atom.model_ops.kernels.triton_import import HAS_TRITON
from atom.model_ops.moe import experts_reference
from atom.model_ops.moe.tile_configs import (TileTable, check_tile, config_file_name, default_config, find_tiles)
from atom.tuning.plan import KernelPlan

TILE = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)


def case(T=9, H=32, I=16, E=4, k=2, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    b13 = torch.randn(E, 2 * I, generator=g) * 0.1 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if bias else None
    weights, ids = torch.randn(T, E, generator=g).softmax(-1).topk(k, dim=-1)
    return x, w13, w2, weights, ids, b13, b2


def dense(x, w13, w2, weights, ids, b13=None, b2=None, act=silu_and_mul_ref):
    """Token by token, expert by expert: the definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.linear(x[t], w13[e], None if b13 is None else b13[e])
            out[t] += weights[t, j] * F.linear(act(h), w2[e], None if b2 is None else b2[e])
    return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T,E,k", [(9, 4, 2), (1, 8, 1), (13, 8, 8)])
def test_reference_matches_dense(T, E, k, bias):
    x, w13, w2, w, ids, b13, b2 = case(T=T, E=E, k=k, bias=bias)
    torch.testing.assert_close(experts_reference(x, w13, w2, w, ids, silu_and_mul_ref, b13, b2),
                               dense(x, w13, w2, w, ids, b13, b2), rtol=1e-5, atol=1e-5)


def test_reference_takes_any_activation_and_no_tokens():
    x, w13, w2, w, ids, _, _ = case()
    gelu = lambda h: F.gelu(h[..., :16]) * h[..., 16:]  # noqa: E731
    torch.testing.assert_close(experts_reference(x, w13, w2, w, ids, gelu), dense(x, w13, w2, w, ids, act=gelu),
                               rtol=1e-5, atol=1e-5)
    assert experts_reference(x[:0], w13, w2, w[:0], ids[:0], silu_and_mul_ref).shape == (0, 32)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
class TestTriton:
    @pytest.mark.parametrize("sort", [True, False])
    @pytest.mark.parametrize("bias", [False, True])
    @pytest.mark.parametrize("T,E,k,I", [(9, 4, 2, 16), (3, 8, 3, 24), (10, 4, 4, 16)])
    def test_fused_experts_matches_dense(self, T, E, k, I, bias, sort):
        from atom.model_ops.moe.experts_triton import fused_experts
        x, w13, w2, w, ids, b13, b2 = case(T=T, E=E, k=k, I=I, H=40, bias=bias)
        got = fused_experts(x, w13, w2, w, ids, silu_and_mul_ref, b13, b2, config=TILE, sort=sort)
        torch.testing.assert_close(got, dense(x, w13, w2, w, ids, b13, b2), rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("T,E,k,I", [(9, 4, 2, 16), (3, 8, 3, 24), (1, 8, 2, 40)])
    def test_silu_runs_inside_the_first_product(self, T, E, k, I, monkeypatch):
        """With the layer's `silu_and_mul` on the sorted path the first product computes
        silu(gate) * up itself (the separate kernel does not run): the definition's result,
        and the unfused path's."""
        from atom.model_ops import activation
        from atom.model_ops.moe import experts_triton
        x, w13, w2, w, ids, _, _ = case(T=T, E=E, k=k, I=I, H=40)
        unfused = experts_triton.fused_experts(x, w13, w2, w, ids, activation.silu_and_mul, config=TILE, sort=True,
                                               fuse_activation=False)
        gated = []
        real = experts_triton.expert_product
        monkeypatch.setattr(experts_triton, "expert_product",
                            lambda *a, **kw: gated.append(kw.get("gated", False)) or real(*a, **kw))
        got = experts_triton.fused_experts(x, w13, w2, w, ids, activation.silu_and_mul, config=TILE, sort=True)
        assert gated == [True, False]
        torch.testing.assert_close(got, unfused, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got, dense(x, w13, w2, w, ids), rtol=1e-4, atol=1e-4)
        gated.clear()  # the unsorted path and a bias keep the separate activation
        experts_triton.fused_experts(x, w13, w2, w, ids, activation.silu_and_mul, config=TILE, sort=False)
        assert gated == [False, False]
        with pytest.raises(ValueError, match="gated product"):
            real(x, w13, None, ids, k, None, TILE, None, gated=True)

    def test_custom_op_and_a_fullgraph_compile_match_the_reference(self):
        """Under torch.compile (fullgraph, as level 3 compiles) the layer calls the Triton path
        through the opaque `atom::moe_experts` op; eager and compiled agree with the reference."""
        from atom.model_ops.moe import FusedMoE, TopK
        from atom.model_ops.moe.experts_op import moe_experts
        x, w13, w2, w, ids, b13, b2 = case(T=6, bias=True)
        table = TileTable(4, 16, 32, "float32", "cpu", {8: TILE})
        got = moe_experts(x, w13, w2, w, ids, b13, b2, "silu", table.to_json())
        torch.testing.assert_close(got, dense(x, w13, w2, w, ids, b13, b2), rtol=1e-4, atol=1e-4)
        layer = FusedMoE(4, 32, 16, TopK(4, 2, renormalize=True))
        layer.load_state_dict({"w13_weight": w13, "w2_weight": w2})
        layer.plan = KernelPlan(moe_kernel="triton")
        layer.plan_installed(layer.plan)
        logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="eager", fullgraph=True)
        with torch.no_grad():
            want = experts_reference(x, w13, w2, *TopK(4, 2, renormalize=True)(logits), silu_and_mul_ref)
            torch.testing.assert_close(compiled(x, logits), want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(layer(x, logits), want, rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("align", ["moe_align", "moe_align_ref"])
    def test_moe_align_groups_pairs_by_expert(self, align):
        from atom.model_ops.moe import experts_triton
        ids = torch.tensor([[3, 1], [1, 0], [3, 1], [2, 3]])
        sorted_pairs, block_expert = getattr(experts_triton, align)(ids, 5, 4)
        P = ids.numel()
        assert sorted_pairs.numel() == block_expert.numel() * 4 == (-(-P // 4) + 5) * 4
        flat = ids.reshape(-1)
        for b, e in enumerate(block_expert.tolist()):
            pairs = [p for p in sorted_pairs[4 * b:4 * b + 4].tolist() if p < P]
            if e < 0:
                assert not pairs
            else:
                assert all(int(flat[p]) == e for p in pairs)
        real = sorted(p for p in sorted_pairs.tolist() if p < P)
        assert real == list(range(P))  # every pair exactly once
        assert block_expert.tolist()[:4] == [0, 1, 2, 3] and 4 not in block_expert.tolist()  # expert 4: no tokens

    @pytest.mark.parametrize("one_program", [False, True])
    @pytest.mark.parametrize("T,E,k,bm", [(1, 8, 2, 16), (37, 16, 4, 16), (300, 64, 6, 32), (5, 3, 3, 4)])
    def test_moe_align_kernels_give_the_reference_layout(self, T, E, k, bm, one_program):
        """The same block experts as the sorted reference, and each block holds the same pairs:
        in the reference's order from the one-program kernel, in the atomics' order inside an
        expert's group from the three kernels."""
        from atom.model_ops.moe.experts_triton import moe_align, moe_align_ref
        g = torch.Generator().manual_seed(T)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        if T > 100:
            ids[: T // 2] = ids[0]  # a crowded expert group spanning several blocks
        want, want_be = moe_align_ref(ids, E, bm)
        blocks = lambda t: [sorted(r) for r in t.view(-1, bm).tolist()]  # noqa: E731
        for dtype in (torch.int64, torch.int32):  # the kernels read either id width
            got, got_be = moe_align(ids.to(dtype), E, bm, one_program=one_program)
            assert torch.equal(got_be, want_be)
            assert blocks(got) == blocks(want)
            if one_program:
                assert torch.equal(got, want)

    def test_moe_align_picks_one_program_for_few_pairs(self, monkeypatch):
        """Few pairs x experts take the one-program kernel (one launch), more the three kernels
    (with the threshold at the size the kernel is written for)."""
        from atom.model_ops.moe import experts_triton
        launched = []

        class Spy:  # kernel[grid](...) as before, noting the launch
            def __init__(self, name):
                self.name, self.kernel = name, getattr(experts_triton, name)

            def __getitem__(self, grid):
                launched.append(self.name)
                return self.kernel[grid]

        for name in ("_moe_align_one_program_kernel", "_moe_count_kernel"):
            monkeypatch.setattr(experts_triton, name, Spy(name))
        ids = torch.zeros(1, 6, dtype=torch.int64)  # one DeepSeek-V2-Lite token: 6 pairs x 64 experts
        experts_triton.moe_align(ids, 64, 16)
        experts_triton.moe_align(torch.zeros(200, 6, dtype=torch.int64), 64, 16)  # 2048 x 64 > 8192
        assert launched == ["_moe_align_one_program_kernel", "_moe_count_kernel"]

    def test_small_batch_rule(self):
        from atom.model_ops.moe.experts_triton import skips_sorting
        assert skips_sorting(16, 8, 128) and not skips_sorting(17, 8, 128)   # Qwen3-30B-A3B: T <= 16
        assert skips_sorting(4, 2, 8) and not skips_sorting(5, 2, 8)         # Mixtral: T <= 4
        tuned = TileTable(8, 16, 32, "float32", "cpu", {1: TILE}, unsorted_max_tokens=2)
        assert skips_sorting(2, 2, 8, tuned) and not skips_sorting(3, 2, 8, tuned)

    def test_plan_chooses_the_kernel(self):
        x = torch.randn(2, 4)
        assert KernelPlan().experts_kernel(x) == "reference"                  # CPU tensors, torch backend
        assert KernelPlan(moe_kernel="triton").experts_kernel(x) == "triton"
        assert KernelPlan(backend="triton", force_kernels=True).experts_kernel(x) == "triton"
        assert KernelPlan(backend="triton", force_kernels=True, moe_kernel="reference").experts_kernel(x) == "reference"
        with pytest.raises(ValueError, match="moe_kernel='cutlass' is invalid"):
            KernelPlan(moe_kernel="cutlass")
        plan = KernelPlan.from_dict(KernelPlan(moe_kernel="triton", moe_config_dirs=("/x",)).to_dict())
        assert plan.moe_kernel == "triton" and plan.moe_config_dirs == ("/x",)


def test_tile_selection_and_files(tmp_path):
    table = TileTable(8, 16, 32, "float32", "NVIDIA H200",
                      {1: dict(TILE, BLOCK_M=16), 64: dict(TILE, BLOCK_M=32), 512: dict(TILE, BLOCK_M=64)}, 4)
    picks = {T: table.config_for(T, 2)["BLOCK_M"] for T in (1, 2, 64, 65, 512, 4096)}
    assert picks == {1: 16, 2: 32, 64: 32, 65: 64, 512: 64, 4096: 64}  # smallest tuned count >= T, else largest
    path = table.save(tmp_path, timings={"1": {"sorted_us": 3.0}})
    assert path.name == "E=8,I=16,H=32,dtype=float32,device=NVIDIA_H200.json"
    assert path.name == config_file_name(8, 16, 32, torch.float32, "NVIDIA H200")
    back = find_tiles(8, 16, 32, torch.float32, "NVIDIA H200", folders=(tmp_path,))
    assert back.configs == table.configs and back.unsorted_max_tokens == 4 and back.source == str(path)
    other = find_tiles(8, 16, 32, torch.float32, "NVIDIA B200", folders=(tmp_path,))  # no file: defaults
    assert other.source is None and other.config_for(1, 2) == default_config(1, 2, 8)
    plan = KernelPlan(moe_config_dirs=(str(tmp_path),))
    x = torch.randn(1, 32)
    assert plan.moe_tiles(8, 16, 32, x.dtype, x.device).source is None  # the CPU is not the H200
    assert (8, 16, 32, "float32", "cpu") in plan.moe_tile_tables and plan.to_frame()["kind"].tolist() == ["moe"]


def test_tiles_frame_shows_the_checked_in_file():
    """A tile file as a table: DeepSeek-V2-Lite's H200 file has a row per tuned count, its
    tiles, the sorted path everywhere (`unsorted_max_tokens` 0) and the tuner's timings."""
    from atom.model_ops.moe.tile_configs import CONFIG_DIR, config_file_name, tiles_frame
    df = tiles_frame(CONFIG_DIR / config_file_name(64, 1408, 2048, "bfloat16", "NVIDIA H200"))
    assert list(df.tokens) == sorted(df.tokens) and {1, 64, 256, 8192} <= set(df.tokens)
    assert set(df.path) == {"sorted"} and (df.sorted_us > 0).all() and (df.tried > 0).all()
    assert {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"} <= set(df.columns)
    assert int(df.set_index("tokens").loc[64, "BLOCK_M"]) <= 32  # few rows an expert: a short tile


def test_malformed_tile_files_are_refused(tmp_path):
    name = config_file_name(8, 16, 32, "float32", "cpu")
    (tmp_path / name).write_text(json.dumps({"experts": 8, "width": 16, "hidden": 32, "dtype": "float32",
                                             "device": "cpu", "configs": {"1": {"BLOCK_M": 16}}}))
    with pytest.raises(ValueError, match="lacks .*BLOCK_N.*moe_tune"):
        find_tiles(8, 16, 32, "float32", "cpu", folders=(tmp_path,))
    with pytest.raises(ValueError, match="BLOCK_K=24 must be powers of two"):
        check_tile(dict(TILE, BLOCK_K=24), "here")


def test_default_tiles_grow_with_rows_per_expert():
    ms = [default_config(T, 8, 128)["BLOCK_M"] for T in (1, 256, 1024, 8192)]
    assert ms == sorted(ms) and ms[0] == 16 and ms[-1] == 64


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_tune_search_and_file(tmp_path):
    """The tuning command's bookkeeping with a stand-in timer (timings mean nothing on a CPU):
    the fastest tile per count wins, the winner is checked against the reference (run under
    the interpreter), and the unsorted crossover is the leading run of counts it won."""
    from atom.tuning.moe_tune import tune
    space = [dict(TILE, BLOCK_M=16), dict(TILE, BLOCK_M=32)]

    def bench(fn, c):
        if not c["sort"]:
            return 1.0 if c["tokens"] <= 2 else 100.0
        return 10.0 + (c["config"]["BLOCK_M"] == 16) * (5.0 if c["tokens"] > 2 else -5.0)

    table, timings = tune(4, 16, 32, 2, torch.float32, tokens=(1, 2, 8), device="cpu", bench=bench, space=space)
    assert {T: cfg["BLOCK_M"] for T, cfg in table.configs.items()} == {1: 16, 2: 16, 8: 32}
    assert table.unsorted_max_tokens == 2 and timings["8"] == {"sorted_us": 10.0, "unsorted_us": 100.0, "tried": 2}
    back = TileTable.from_file(table.save(tmp_path, timings))
    assert back.configs == table.configs


def test_tune_quick_space_is_a_subset_of_the_full_one():
    from atom.tuning.moe_tune import search_space
    full, quick = search_space(), search_space("quick")
    key = lambda c: tuple(sorted(c.items()))  # noqa: E731
    assert 0 < len(quick) <= len(full) / 3 and {key(c) for c in quick} <= {key(c) for c in full}  # ~a quarter
    with pytest.raises(ValueError, match="space='huge' is invalid: choose one of full, quick"):
        search_space("huge")


def test_tune_times_only_tiles_that_fit_the_rows_per_expert():
    """At few tokens a tall tile is mostly padding: DeepSeek-V2-Lite (64 experts, top-6) at 64
    tokens has 6 rows an expert, so BLOCK_M 16 and 32 are timed, 64 and 128 are not; at 2048
    tokens (192 rows) every height is."""
    from atom.tuning.moe_tune import fits_tokens, search_space, tune
    heights = lambda T: sorted({c["BLOCK_M"] for c in search_space("quick") if fits_tokens(c, T, 6, 64)})  # noqa: E731
    assert heights(1) == heights(64) == [16, 32] and heights(200) == [16, 32, 64]
    assert heights(2048) == [16, 32, 64, 128]
    timed = []
    space = [dict(TILE, BLOCK_M=m) for m in (16, 32, 64)]
    tune(4, 16, 32, 2, torch.float32, tokens=(1,), device="cpu", space=space, check=False,
         bench=lambda fn, c: timed.append((c["config"]["BLOCK_M"], c["sort"])) or 1.0)
    assert timed == [(16, True), (32, True), (16, False)]
    timed.clear()
    tune(4, 16, 32, 2, torch.float32, tokens=(1,), device="cpu", space=space, check=False, prune=False,
         bench=lambda fn, c: timed.append((c["config"]["BLOCK_M"], c["sort"])) or 1.0)
    assert [m for m, s in timed if s] == [16, 32, 64]


def test_tune_writes_sorted_everywhere_when_unsorted_loses_first():
    """An unsorted path slower at the smallest count gives unsorted_max_tokens 0, which the
    small-batch rule reads as "always sort" (None would fall back to T*k <= E and pick the
    slower path at one token)."""
    from atom.model_ops.moe.experts_triton import skips_sorting
    from atom.tuning.moe_tune import tune
    table, _ = tune(64, 16, 32, 6, torch.float32, tokens=(1, 4), device="cpu", space=[TILE], check=False,
                    bench=lambda fn, c: 50.0 if c["sort"] else (80.0 if c["tokens"] == 1 else 20.0))
    assert table.unsorted_max_tokens == 0
    assert not skips_sorting(1, 6, 64, table) and skips_sorting(1, 6, 64, None)


def test_tune_command_needs_a_gpu(capsys):
    from atom.tuning.moe_tune import main
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert main(["--experts", "4", "--width", "16", "--hidden", "32", "--top-k", "2"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "GPU" in err


def test_tune_reads_the_shape_of_a_model(tmp_path):
    from atom.benchmarks.workloads import write_model_config
    from atom.tuning.moe_tune import shape_of_model
    assert shape_of_model(write_model_config("qwen3-30b-a3b", str(tmp_path / "q"))) == \
        dict(experts=128, width=768, hidden=2048, top_k=8)
    assert shape_of_model(write_model_config("mixtral-8x7b", str(tmp_path / "m"))) == \
        dict(experts=8, width=14336, hidden=4096, top_k=2)
    with pytest.raises(ValueError, match="names no experts"):
        shape_of_model(write_model_config("qwen3-0.6b", str(tmp_path / "d")))


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,bm", [(1, 64, 6, 16), (21, 64, 6, 16), (8, 128, 8, 16), (4, 256, 8, 64), (40, 8, 2, 16)])
def test_moe_align_one_program_on_gpu(T, E, k, bm):
    """The one-program layout on a GPU (its fill and the pairs' rows ordered by the barrier)
    equals the reference exactly, at the decode sizes it serves, a crowded expert included.
    Each call gets a different routing and memory the allocator last handed out full of -7,
    so a fill or a row that never landed shows."""
    from atom.model_ops.moe.experts_triton import moe_align, moe_align_ref
    g = torch.Generator().manual_seed(T * E)
    for _ in range(3):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        ids[: T // 2 + 1, 0] = 3
        num_blocks = -(-T * k // bm) + E
        junk = torch.full((num_blocks * bm + num_blocks,), -7, dtype=torch.int32, device="cuda")
        del junk  # its block goes back to the caching allocator, -7s and all
        got, got_be = moe_align(ids.cuda(), E, bm, one_program=True)
        want, want_be = moe_align_ref(ids, E, bm)
        assert torch.equal(got.cpu(), want) and torch.equal(got_be.cpu(), want_be)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 2048])
@pytest.mark.parametrize("shape", [(128, 768, 2048, 8), (8, 1792, 4096, 2)])  # Qwen3-30B-A3B; Mixtral at width / 8
def test_fused_experts_bf16_on_gpu(T, shape):
    from atom.model_ops.activation import silu_and_mul
    from atom.model_ops.moe.experts_triton import fused_experts
    from atom.tuning.moe_tune import make_case
    E, I, H, k = shape
    x, w13, w2, w, ids = make_case(E, I, H, k, T, torch.bfloat16, "cuda")
    ref = experts_reference(x, w13, w2, w, ids, silu_and_mul).float()
    for sort in (True, False):
        got = fused_experts(x, w13, w2, w, ids, silu_and_mul, sort=sort).float()
        assert float((got - ref).abs().max() / ref.abs().max()) < 2e-2, sort
    # SiLU inside the first product: the gate and up sums in the same K order, rounded as the
    # separate kernel reads them, so the same bf16 activations
    fused = fused_experts(x, w13, w2, w, ids, silu_and_mul, sort=True)
    unfused = fused_experts(x, w13, w2, w, ids, silu_and_mul, sort=True, fuse_activation=False)
    torch.testing.assert_close(fused, unfused, rtol=8e-3, atol=1e-3 * float(unfused.abs().max()))
    assert float((fused.float() - unfused.float()).abs().mean()) <= 1e-3 * float(unfused.float().abs().mean())


def test_experts_benchmark_floor_and_shapes(capsys):
    from atom.benchmarks.moe_experts import experts_floor_s, main, moe_shape
    assert moe_shape("qwen3-30b-a3b") == (128, 768, 2048, 8) and moe_shape("mixtral-8x7b") == (8, 14336, 4096, 2)
    assert moe_shape("deepseek-v2-lite") == (64, 1408, 2048, 6)  # n_routed_experts
    with pytest.raises(ValueError, match="has no experts"):
        moe_shape("qwen3-0.6b")
    ids = torch.tensor([[0, 5], [5, 7]])  # 3 experts activated
    want = (3 * 3 * 2048 * 768 * 2 + 2 * 2 * 2048 * 2) / 4.3e12
    assert experts_floor_s(ids, 768, 2048) == pytest.approx(want)
    if not torch.cuda.is_available():
        assert main(["--model", "mixtral-8x7b"]) == 2 and "needs a GPU" in capsys.readouterr().err
