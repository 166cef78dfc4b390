"""Triton, when installed: `HAS_TRITON`, `triton`, `tl` (None without it), so that every
kernel file stays importable (its torch reference too) on machines without Triton."""
try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = tl = None
    HAS_TRITON = False
