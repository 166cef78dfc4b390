"""Powers of two for launch shapes (tiles, pads, segment counts), without Triton."""
from __future__ import annotations


def is_pow2(v) -> bool:
    """Whether v is a positive int power of two (1, 2, 4, ...): a tile entry Triton can take."""
    return isinstance(v, int) and v > 0 and not v & (v - 1)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()
