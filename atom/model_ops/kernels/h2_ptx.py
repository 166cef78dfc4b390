"""PTX of the one-row 4-bit GEMV's fp16 pair products (`w4_gemv1`, HALF2), generated.

`h2_ptx(fmt, words)` is one inline-asm body: operands $0 (the float32 sum, as int32 bits),
$1..$W the W words, then four fp16 x pairs a word (pair i: columns i and i + 4 of the word,
x scaled as `w4_gemv1._h2_column_x` does). Per word each pair of codes (i, i + 4) becomes the
two fp16 halves of one int32 and one fp16 pair FMA adds its products into one accumulator,
word after word (CHAIN: two words of a thread's 8-byte load in one chain); the two halves
are then added in fp16 and widened once. The decodes, by format:
- int4: nibbles (0, 4), (1, 5) masked in place, (2, 6), (3, 7) after one shift of the word by
  8: fp16 subnormals u 2^-24 (16 u 2^-24 for odd nibbles, whose x the caller divides by 16);
- mxfp4 (the checkpoint's layout): for pair i the exponent-mantissa bits shifted to 9-11 /
  25-27 and masked, the sign bits to 15 / 31 and masked, or'd: e2m1 x 2^-14;
- mxfp4_pairs (`fp4_pairs` words): the same values from the shifts `fp4_pairs.EM_SHIFT` /
  `SIGN_SHIFT`, each issued once a word, and one mask (both fields from one shift) or two.
"""
from __future__ import annotations

from atom.model_ops.kernels import fp4_pairs

_FMA = "fma.rn.f16x2 acc, {p}, {x}, acc;"
#: the nonzero shifts of a pair word's decode, each one register t<s>
_SHIFTS = sorted(set(fp4_pairs.EM_SHIFT + fp4_pairs.SIGN_SHIFT) - {0})


def _product(p: str, x: str, first: bool) -> str:
    return f"mul.rn.f16x2 acc, {p}, {x};" if first else _FMA.format(p=p, x=x)


def _int4(w: str, xs: list[str], first: bool) -> list[str]:
    return [f"and.b32 p, {w}, 0x000F000F;", f"and.b32 q, {w}, 0x00F000F0;", _product("p", xs[0], first),
            _product("q", xs[1], False), f"shr.u32 s, {w}, 8;", "and.b32 p, s, 0x000F000F;",
            "and.b32 q, s, 0x00F000F0;", _product("p", xs[2], False), _product("q", xs[3], False)]


def _mxfp4(w: str, xs: list[str], first: bool) -> list[str]:
    lines = []
    for i in range(4):  # codes i and i + 4: exponent-mantissa bits to 9-11 / 25-27, signs to 15 / 31
        em = f"shl.b32 p, {w}, {9 - 4 * i};" if i < 3 else f"shr.u32 p, {w}, 3;"
        sign = f"shl.b32 q, {w}, {12 - 4 * i};" if i < 3 else f"mov.b32 q, {w};"
        lines += [em, f"and.b32 p, p, {fp4_pairs.EM_MASK:#010x};", sign, f"and.b32 q, q, {fp4_pairs.SIGN_MASK:#010x};",
                  "or.b32 p, p, q;", _product("p", xs[i], first and i == 0)]
    return lines


def _mxfp4_pairs(w: str, xs: list[str], first: bool) -> list[str]:
    lines = [f"shl.b32 t{s}, {w}, {s};" for s in _SHIFTS]
    reg = {0: w, **{s: f"t{s}" for s in _SHIFTS}}
    em_mask, sign_mask = fp4_pairs.EM_MASK, fp4_pairs.SIGN_MASK
    for i, (a, b) in enumerate(zip(fp4_pairs.EM_SHIFT, fp4_pairs.SIGN_SHIFT)):
        if a == b:
            lines.append(f"and.b32 p, {reg[a]}, {em_mask | sign_mask:#010x};")
        else:
            lines += [f"and.b32 p, {reg[a]}, {em_mask:#010x};", f"and.b32 q, {reg[b]}, {sign_mask:#010x};",
                      "or.b32 p, p, q;"]
        lines.append(_product("p", xs[i], first and i == 0))
    return lines


DECODES = {"int4": _int4, "mxfp4": _mxfp4, "mxfp4_pairs": _mxfp4_pairs}


def h2_ptx(fmt: str, words: int = 1) -> str:
    """The inline-asm body for `words` words of format `fmt` (module docstring)."""
    if fmt not in DECODES or words < 1:
        raise ValueError(f"h2_ptx: fmt={fmt!r} (allowed {sorted(DECODES)}), words={words} (>= 1)")
    temps = ", ".join(f"t{s}" for s in _SHIFTS)
    lines = []
    for k in range(words):
        xs = [f"${1 + words + 4 * k + i}" for i in range(4)]
        lines += DECODES[fmt](f"${1 + k}", xs, k == 0)
    return ("{\n.reg .b32 p, q, s, acc, " + temps + ";\n.reg .b16 l, h;\n.reg .f32 fl;\n" + "\n".join(lines)
            + "\nmov.b32 {l, h}, acc;\nadd.rn.f16 l, l, h;\ncvt.f32.f16 fl, l;\nmov.b32 $0, fl;\n}")


def constraints(words: int = 1) -> str:
    """The inline asm's operand constraints: one int32 out, the words and their x pairs in."""
    return "=r," + ",".join(["r"] * (5 * words))
