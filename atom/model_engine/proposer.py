"""`Proposer`: where draft tokens for multi-token (speculative) steps come from.

Before each scheduled step the engine hands its proposer the running sequences that
decode next (their last token is the only one without K/V) and stores what it returns in
`Sequence.draft_token_ids`. The scheduler runs those drafts in the step (1 + k query
tokens), the model samples at every position, and `Scheduler.commit` keeps the drafts
that equal the target's own samples, so outputs follow the target model whatever the
proposer guesses: a good proposer only makes steps yield more tokens.

A proposer is any object with this method (a draft model, n-gram lookup, a test double):
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from atom.model_engine.sequence import Sequence


@runtime_checkable
class Proposer(Protocol):
    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """Draft tokens to follow each sequence's last token (one list per sequence; an empty
        list: no drafts). Called on the host before scheduling; `seq.token_ids` is known."""
        ...
