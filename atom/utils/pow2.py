"""Powers of two for launch shapes (tiles, pads, segment counts), without Triton."""
from __future__ import annotations


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()
