"""Incremental detokenization, stop strings and streamed text.

Each step decodes only a short window of the newest tokens (from `prefix_offset`),
not the whole output, and holds text back while it ends in an incomplete UTF-8 character.
Streaming (`stream_text`) also holds back the last `len(longest stop string) - 1`
characters of a request with stop strings: they may turn out to start a stop string, and
text once streamed cannot be taken back.
"""
from __future__ import annotations

import logging

from atom.model_engine.sequence import Sequence

logger = logging.getLogger(__name__)

WINDOW = 6  # tokens of context kept before the new ones, so merges decode right


def detokenize_incrementally(tokenizer, seq: Sequence) -> str:
    """Append the newly decodable text of `seq` to seq.output_text; return the new text."""
    start = seq.num_prompt_tokens + seq.prefix_offset  # slice only the window, not the output
    end = seq.num_tokens - seq.num_pending - seq.num_draft_tokens
    ids = seq.token_ids[start:end]
    split = seq.read_offset - seq.prefix_offset
    prefix = tokenizer.decode(ids[:split], skip_special_tokens=True)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    new = full[len(prefix):]
    seq.output_text += new
    seq.read_offset = end - seq.num_prompt_tokens
    seq.prefix_offset = max(0, seq.read_offset - WINDOW)
    return new


def find_stop_string(seq: Sequence, new_text: str, stop_strings: list[str]) -> str | None:
    """If a stop string appeared, cut the text where it starts and return that string."""
    if not new_text:
        return None
    longest = max(len(s) for s in stop_strings)
    search_from = max(0, len(seq.output_text) - len(new_text) - longest + 1)
    for stop in stop_strings:
        at = seq.output_text.find(stop, search_from)
        if at != -1:
            seq.output_text = seq.output_text[:at]
            return stop
    return None


def stream_text(seq: Sequence, final_text: str | None = None) -> tuple[str, str]:
    """(text so far, text new since the request's previous output), and mark it streamed.

    Unfinished (`final_text` None): the detokenized text, less what stop strings hold back.
    Finished: `final_text`, whose start is what was streamed before (warned if a
    tokenizer decodes a whole output differently from its pieces)."""
    done = seq.num_streamed_chars
    if final_text is None:
        text = seq.output_text
        stops = seq.sampling_params.stop_strings
        if stops:
            hold = max(len(s) for s in stops) - 1
            text = text[:max(done, len(text) - hold)]
    else:
        text = final_text
        if done and not text.startswith(seq.output_text[:done]):
            logger.warning("request %s: its final text does not start with the text streamed before",
                           seq.request_id)
    seq.num_streamed_chars = len(text)
    return text, text[done:]
