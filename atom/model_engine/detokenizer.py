"""Incremental detokenization and stop strings.

Each step decodes only a short window of the newest tokens (from `prefix_offset`),
not the whole output, and holds text back while it ends in an incomplete UTF-8 character.
"""
from __future__ import annotations

from atom.model_engine.sequence import Sequence

WINDOW = 6  # tokens of context kept before the new ones, so merges decode right


def detokenize_incrementally(tokenizer, seq: Sequence) -> str:
    """Append the newly decodable text of `seq` to seq.output_text; return the new text."""
    ids = seq.output_token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=True)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    new = full[len(prefix):]
    seq.output_text += new
    seq.read_offset = len(ids)
    seq.prefix_offset = max(0, seq.read_offset - WINDOW)
    return new


def find_stop_string(seq: Sequence, new_text: str, stop_strings: list[str]) -> bool:
    """If a stop string appeared, cut the text where it starts and return True."""
    if not new_text:
        return False
    longest = max(len(s) for s in stop_strings)
    search_from = max(0, len(seq.output_text) - len(new_text) - longest + 1)
    for stop in stop_strings:
        at = seq.output_text.find(stop, search_from)
        if at != -1:
            seq.output_text = seq.output_text[:at]
            return True
    return False
