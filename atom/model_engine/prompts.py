"""What a user may pass as a prompt, turned into one form: `Prompt(text, token_ids)`.

One prompt is any of
- a string: text, tokenized by the engine;
- token ids: a list or tuple of ints (numpy / torch integer scalars too), a 1-D numpy integer
  array or a 1-D torch integer tensor;
- a vLLM-style dict: `{"prompt": "text"}` or `{"prompt_token_ids": [...]}` (the latter may
  also carry `"prompt"`, kept as the output's prompt text).
Several prompts are a list (or tuple) of these, or a 2-D integer array / tensor (one row
each). `split_prompts` splits what `LLM.generate` was given into single prompts,
`parse_prompt` checks one (`LLMEngine.add_request` takes the same forms). A value that is no prompt is a
`TypeError` naming what was passed and what is allowed; whether ids are in the vocabulary
is the engine's check (`LLMEngine.add_request`). `as_sampling_params` takes a
`SamplingParams` or a dict of its fields (as vLLM users pass them).
"""
from __future__ import annotations

import dataclasses
import numbers
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

ALLOWED = ("a string, a list/tuple of token ids, a 1-D integer numpy array or torch tensor, "
           "{'prompt': str} or {'prompt_token_ids': [int, ...]}")
DICT_KEYS = ("prompt", "prompt_token_ids")


@dataclass(frozen=True)
class Prompt:
    """One parsed prompt: text (tokenized by the engine) or token ids, or both (ids win)."""
    text: str | None = None
    token_ids: list[int] | None = None


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _is_int_scalar(x: Any) -> bool:
    """A Python, numpy or 0-d torch integer (not a bool)."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, numbers.Integral):  # int, np.int64, ...
        return True
    return _is_tensor(x) and x.ndim == 0 and _tensor_is_int(x)


def _is_tensor(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _torch():
    return sys.modules.get("torch")  # a tensor can only exist if torch was imported (no import here)


def _tensor_is_int(t) -> bool:
    torch = _torch()
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


def _array_ids(a, what: str) -> list[int]:
    """A 1-D integer numpy array or torch tensor -> a list of ints."""
    is_int = _tensor_is_int(a) if _is_tensor(a) else np.issubdtype(a.dtype, np.integer)
    if not is_int or a.ndim != 1:
        raise TypeError(f"{what}={_describe(a)} is not a prompt: an array of token ids must be "
                        f"1-D and of an integer dtype (got {a.ndim}-D {a.dtype})")
    return [int(t) for t in a.tolist()]


def _list_ids(seq, what: str) -> list[int]:
    if all(type(t) is int for t in seq):  # the common case, fast
        return list(seq)
    bad = [(i, t) for i, t in enumerate(seq) if not _is_int_scalar(t)]
    if bad:
        i, t = bad[0]
        raise TypeError(f"{what} has token id {_describe(t)} at index {i}: token ids must be "
                        "integers (a list of ids is one prompt)")
    return [int(t) for t in seq]


def parse_prompt(prompt: Any, what: str = "prompt") -> Prompt:
    """One prompt in any accepted form -> `Prompt`; `what` names it in errors."""
    if isinstance(prompt, Prompt):
        return prompt
    if isinstance(prompt, str):
        return Prompt(text=prompt)
    if isinstance(prompt, dict):
        return _parse_dict(prompt, what)
    if isinstance(prompt, (list, tuple)):
        return Prompt(token_ids=_list_ids(prompt, what))
    if isinstance(prompt, np.ndarray) or _is_tensor(prompt):
        if prompt.ndim == 0:
            raise TypeError(f"{what}={_describe(prompt)} is not a prompt: allowed are {ALLOWED} "
                            "(one token id is [id])")
        return Prompt(token_ids=_array_ids(prompt, what))
    hint = " (one token id is [id])" if _is_int_scalar(prompt) else ""
    raise TypeError(f"{what}={_describe(prompt)} is not a prompt: allowed are {ALLOWED}{hint}")


def _parse_dict(d: dict, what: str) -> Prompt:
    keys = sorted(map(str, d))
    if not d or set(d) - set(DICT_KEYS):
        raise TypeError(f"{what} is a dict with keys {keys}: allowed are {{'prompt': str}} or "
                        f"{{'prompt_token_ids': [int, ...]}} (keys {list(DICT_KEYS)})")
    text = d.get("prompt")
    if ("prompt" in d or "prompt_token_ids" not in d) and not isinstance(text, str):
        raise TypeError(f"{what}['prompt']={_describe(text)} is invalid: must be a string")
    if "prompt_token_ids" not in d:
        return Prompt(text=text)
    ids = d["prompt_token_ids"]
    if isinstance(ids, (list, tuple)):
        return Prompt(text, _list_ids(ids, f"{what}['prompt_token_ids']"))
    if isinstance(ids, np.ndarray) or _is_tensor(ids):
        return Prompt(text, _array_ids(ids, f"{what}['prompt_token_ids']"))
    raise TypeError(f"{what}['prompt_token_ids']={_describe(ids)} is invalid: must be a list of "
                    "token ids")


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, (str, dict, Prompt)):
        return True
    if isinstance(prompts, (list, tuple)):  # non-empty and all ids: one prompt
        return bool(prompts) and (all(type(t) is int for t in prompts)
                                  or all(_is_int_scalar(t) for t in prompts))
    if isinstance(prompts, np.ndarray) or _is_tensor(prompts):
        return prompts.ndim == 1
    return False


def split_prompts(prompts: Any) -> list:
    """What `generate` was given -> a list of single prompts (not parsed yet)."""
    if _is_single(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    if (isinstance(prompts, np.ndarray) or _is_tensor(prompts)) and prompts.ndim == 2:
        return list(prompts)  # one row each
    hint = " (one token id is [id])" if _is_int_scalar(prompts) else ""
    raise TypeError(f"prompts={_describe(prompts)} is invalid: pass one prompt ({ALLOWED}) or a "
                    f"list of them{hint}")



def as_sampling_params(sp: Any, what: str = "sampling_params"):
    """A `SamplingParams`, or a dict of its fields (vLLM users pass those) -> SamplingParams."""
    from atom.sampling_params import SamplingParams
    if isinstance(sp, SamplingParams):
        return sp
    if isinstance(sp, dict):
        allowed = [f.name for f in dataclasses.fields(SamplingParams)]
        unknown = sorted(set(map(str, sp)) - set(allowed))
        if unknown:
            raise TypeError(f"{what} is a dict with unknown keys {unknown}: allowed are the fields "
                            f"of SamplingParams {allowed}")
        return SamplingParams(**sp)
    raise TypeError(f"{what}={_describe(sp)} is invalid: pass SamplingParams(...) (or a dict of "
                    "its fields)")
