"""Scenarios that `AsyncLLMEngine` passes in both its modes (the engine on a thread of this
process, or in a child process): the tests of each mode run them and check what they return."""
from __future__ import annotations

import asyncio

import pytest

from atom import SamplingParams


async def collect(eng, prompt, sp) -> list:
    """Every output of one stream."""
    return [out async for out in eng.generate(prompt, sp)]


async def refuse_one_and_leave_one(eng, sp, idle, tries: int = 500) -> list:
    """A request streams while a bad one (a token id past the vocabulary) is refused by
    `add_request` and a third is left by its client after its first output; then waits,
    bounded, until `idle()` (the engine freed what the left request held). Returns the
    streaming request's outputs."""
    good = asyncio.create_task(collect(eng, [5, 6], sp))
    with pytest.raises(ValueError, match="prompt token ids"):
        await eng.add_request([5, 10**6], sp)
    agen = eng.generate([7, 8, 9], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    first = await agen.__anext__()          # it runs ...
    assert not first.finished
    await agen.aclose()                     # ... and the client leaves
    outs = await good
    for _ in range(tries):
        if idle():
            break
        await asyncio.sleep(0.01)
    return outs
