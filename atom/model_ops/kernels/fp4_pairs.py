"""MXFP4 words repacked for the one-row GEMV's fp16 pair products ("pair words").

The one-row GEMV (`w4_gemv1`, HALF2) turns codes i and i + 4 of a word (columns i, i + 4) into
the two fp16 halves of one int32, each e2m1 x 2^-14: the code's exponent-mantissa bits at
fp16 bits 9-11 (25-27), its sign at bit 15 (31). In the checkpoint's layout (code i at bits
4i..4i+3, the sign on top) the sign sits one bit above the exponent-mantissa field where fp16
needs it four bits above, so every pair takes two shifts and two masks (15 instructions a
word in sm90 SASS, where a mask and the or after it are one LOP3, and pair 3's sign needs no
shift). A pair word places the same
32 bits so that one left shift by `EM_SHIFT[i]` brings pair i's exponent-mantissa fields to
9-11 / 25-27 and one by `SIGN_SHIFT[i]` its signs to 15 / 31, with shifts shared: pairs 0 and
1 take one shift (none for pair 0) and one mask for both fields, pairs 2 and 3 two shifts
each (of five in all) and two masks: 11 instructions a word. No bit placement does better
with one shift and mask a pair: no four shifts of the pattern {9, 10, 11, 15} tile a 16-bit
half (an exhaustive search, over two words too).

Bit places (the same in both halves; `+ 16` for code i + 4):
    pair i: exponent-mantissa bits at 9 - EM_SHIFT[i] .. 11 - EM_SHIFT[i], sign at 15 - SIGN_SHIFT[i]
    i = 0: 9-11, 15;  i = 1: 6-8, 12;  i = 2: 3-5, 13;  i = 3: 0-2, 14.
No field crosses a half, and every shift is a plain left shift (no wrap-around), so the
compiler may issue it on the multiply pipe.

`pair_words` / `standard_words` convert (torch, any device); `fold_scales` checks and sets a
layer's scale bytes for the one-row GEMV's folded scale multiply
(`w4_gemv1.FOLD_PAIR_SCALES`); `pair_values` decodes a pair the way the kernel's PTX (`h2_ptx`)
does, for the tests; `layout_frame` is the placement as a DataFrame (a row a word column).
"""
from __future__ import annotations

import torch

#: left shifts that bring pair i's exponent-mantissa bits / sign bits to fp16's places
EM_SHIFT = (0, 3, 6, 9)
SIGN_SHIFT = (0, 3, 2, 1)
EM_MASK = 0x0E000E00    # bits 9-11 and 25-27
SIGN_MASK = 0x80008000  # bits 15 and 31


def _moves() -> list[tuple[int, int, int]]:
    """(standard bit, pair-word bit, count) runs of every code's bits, both halves."""
    moves = []
    for i in range(4):
        for half in (0, 16):
            std = 4 * i + half  # code i (i + 4 in the high half)
            moves.append((std, 9 - EM_SHIFT[i] + half, 3))        # exponent-mantissa bits
            moves.append((std + 3, 15 - SIGN_SHIFT[i] + half, 1))  # sign
    return moves


MOVES = tuple(_moves())


#: the E8M0 scale bytes (blocks with a nonzero code) of a pair-word layer (`Mxfp4LinearMethod`
#: repacks no other), for `w4_gemv1.FOLD_PAIR_SCALES`: the one-row GEMV's HALF2 loop multiplies a
#: chain's sum by 2^(e - 127) 2^(s - 127) as one float, the one whose exponent field is
#: e + s - 127 (x's column exponent e lies in [40, 254]: `h2_xpack._h2_column_e`), a normal float
#: and so exact for every e only while s lies in this range (blocks of 32 weights up to
#: 6 x 2^-39 .. 6 in magnitude: real checkpoints' linear layers)
FOLD_SCALES = (88, 127)
#: the byte an all-zero block takes for the fold (its products are zero whatever its scale)
ZERO_BLOCK_SCALE = 127


def fold_scales(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """The scales a pair-word layer keeps under the fold: `scales` (uint8 [N, K / 32]) with each
    block whose codes are all zero (+0 or -0; `words` int32 [N, K / 8] in the checkpoint's layout,
    four words a block) set to ZERO_BLOCK_SCALE, if every other block's scale lies in FOLD_SCALES;
    None if one does not (the layer then keeps the checkpoint's layout, whose loop applies each
    scale on its own)."""
    n, n_words = words.shape
    if scales.dtype != torch.uint8 or scales.shape != (n, n_words // 4) or n_words % 4:
        raise ValueError(f"fold_scales: scales {tuple(scales.shape)} {scales.dtype} do not match words "
                         f"{tuple(words.shape)} (uint8, one per 4 words)")
    zero = ((words & 0x77777777) == 0).reshape(n, n_words // 4, 4).all(dim=-1)  # each code's sign bit masked
    lo, hi = FOLD_SCALES
    if bool((~zero & ((scales < lo) | (scales > hi))).any()):
        return None
    return torch.where(zero, torch.full_like(scales, ZERO_BLOCK_SCALE), scales)


CHUNK = 1 << 22  # words converted at a time: int64 temporaries of a few tens of MB, whatever the layer


def _move(words: torch.Tensor, to_pairs: bool) -> torch.Tensor:
    flat = words.reshape(-1)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), CHUNK):
        w = flat[start:start + CHUNK].to(torch.int64) & 0xFFFFFFFF
        moved = torch.zeros_like(w)
        for std, pair, n in MOVES:
            src, dst = (std, pair) if to_pairs else (pair, std)
            moved |= ((w >> src) & ((1 << n) - 1)) << dst
        out[start:start + CHUNK] = torch.where(moved >= 2**31, moved - 2**32, moved).to(torch.int32)
    return out.reshape(words.shape)


def pair_words(words: torch.Tensor) -> torch.Tensor:
    """int32 MXFP4 words in the checkpoint's layout (its uint8 bytes viewed as int32: code i
    of a word at bits 4i..4i+3) -> pair words (module docstring), same shape."""
    if words.dtype != torch.int32:
        raise ValueError(f"pair_words: words must be int32 (MXFP4 bytes viewed as int32), got {words.dtype}")
    return _move(words, to_pairs=True)


def standard_words(pairs: torch.Tensor) -> torch.Tensor:
    """The inverse of `pair_words`."""
    if pairs.dtype != torch.int32:
        raise ValueError(f"standard_words: pair words must be int32, got {pairs.dtype}")
    return _move(pairs, to_pairs=False)


def layout_frame():
    """The placement, a row per column of a word (0..7): the checkpoint's bits of its code, the
    pair word's bits of its exponent-mantissa field and sign, and the left shifts that bring
    them to the fp16 half's places (9-11 and 15, or 25-27 and 31)."""
    import pandas as pd
    rows = []
    for col in range(8):
        i, half = col % 4, 16 * (col // 4)
        em = 9 - EM_SHIFT[i] + half
        rows.append(dict(column=col, checkpoint_bits=f"{4 * col}-{4 * col + 3}", pair_em_bits=f"{em}-{em + 2}",
                         pair_sign_bit=15 - SIGN_SHIFT[i] + half, em_shift=EM_SHIFT[i], sign_shift=SIGN_SHIFT[i]))
    return pd.DataFrame(rows).set_index("column")


def pair_values(pairs: torch.Tensor) -> torch.Tensor:
    """The kernel's decode of pair words [..., W] in torch: for pair i, the word shifted left by
    EM_SHIFT[i] masked to EM_MASK, or'd with it shifted by SIGN_SHIFT[i] masked to SIGN_MASK,
    read as two fp16 (the low half column i, the high half i + 4). Returns fp32 [..., W, 8]
    in column order 0..7: each e2m1 x 2^-14."""
    w = pairs.to(torch.int64) & 0xFFFFFFFF
    cols = [None] * 8
    for i in range(4):
        p = (((w << EM_SHIFT[i]) & EM_MASK) | ((w << SIGN_SHIFT[i]) & SIGN_MASK)) & 0xFFFFFFFF
        lo, hi = (p & 0xFFFF).to(torch.int16), ((p >> 16) & 0xFFFF).to(torch.int16)
        cols[i] = lo.view(torch.float16).float()
        cols[i + 4] = hi.view(torch.float16).float()
    return torch.stack(cols, dim=-1)
