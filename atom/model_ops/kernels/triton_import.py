"""Triton, when installed: `HAS_TRITON`, `triton`, `tl` (None without it), so that every
kernel file stays importable (its torch reference too) on machines without Triton.

Also programmatic dependent launch (PDL, NVIDIA sm90+): a kernel launched with it may be
scheduled while the kernel in front of it in the stream runs its last programs, which hides
the launch and ramp-up between the ~10 small kernels of a decoder layer at batch 1 (and, in
front of and behind cuBLAS's products at larger batches, up to 2% of a layer's chain:
`scripts/layer_chain_probe.py`). A kernel that takes part starts with `pdl_start(PDL)`
(before anything that reads what earlier kernels wrote, and before any write or early
return; what no kernel in the stream writes, such as the weights of a loaded model, may
come first) and is launched with `**pdl_args(tensor)`."""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = tl = None
    HAS_TRITON = False

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

# A switch for A/B measurements: False launches every kernel the ordinary way.
USE_PDL = True

# fp8 x fp8 tensor-core sums on sm90 keep fewer bits than fp32 (Triton's default there never
# promotes them: `max_num_imprecise_acc` 2**30), which over a 4096-long row moved outputs by
# up to ~2% of the row's largest. The fp8 kernels pass `max_num_imprecise_acc=` this many
# products of K (or BLOCK_K, if smaller) so that partial sums are added into the fp32
# accumulator every FP8_PROMOTE_K, as cuBLAS does without "fast accumulation". Other GPUs and
# the interpreter ignore it.
FP8_PROMOTE_K = 128

if HAS_TRITON:

    @triton.jit
    def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
        """(row tile, column tile) of program `pid` when programs walk GROUP_M row tiles per
        column tile before the next column (neighbours share weight tiles in L2): the
        ordering of the project's tl.dot GEMMs."""
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m

    FP8_PROMOTE = tl.constexpr(FP8_PROMOTE_K)

    @triton.jit
    def pdl_launch(PDL: tl.constexpr):
        """The next kernel may be scheduled once all our programs have run this."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Every kernel before this one has finished and its writes are visible. What comes
        before it may read only what no kernel in the stream writes (host-copied inputs, the
        weights); its writes wait."""
        if PDL:
            gdc_wait()

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        pdl_launch(PDL)
        pdl_wait(PDL)

    @triton.jit
    def prefetch_l2(ptrs, mask):
        """prefetch.global.L2 of each address where mask holds (a hint: L2 is where the GPU's
        memory is coherent, so a line fetched early is never stale; safe before `pdl_wait`).
        NVIDIA only (inline PTX); returns nothing useful."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
            "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def pdl_args(t: torch.Tensor) -> dict:
    """Launch arguments of a PDL-aware kernel working on `t`: the kernel's `PDL` flag, and
    Triton's `launch_pdl` where it applies (off the interpreter, on NVIDIA sm90+)."""
    on = USE_PDL and t.is_cuda and gdc_wait is not None \
        and compiled_for_sm90(t.device.index if t.device.index is not None else 0)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@functools.lru_cache(maxsize=None)
def compiled_for_sm90(index: int) -> bool:
    """Kernels on this device are compiled for NVIDIA sm90+ (not ROCm, not the interpreter):
    what PDL and the GEMM's TMA loads need. Once per device (the interpreter setting is fixed
    when the kernels are defined)."""
    return (torch.version.hip is None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and torch.cuda.get_device_capability(index)[0] >= 9)
