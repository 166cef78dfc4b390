"""`LLM`: the façade. Builds a `Config` from keywords and wires the engine.

    llm = LLM("path/to/model", max_num_seqs=64)
    outs = llm.generate(["Hello", "Hi"], SamplingParams(temperature=0, max_tokens=16))

`generate` returns one `RequestOutput` per prompt, in input order. A prompt that cannot be
served (empty, too long, bad token ids, bad sampling parameters) comes back with
`finish_reason="error"` and the reason in `.error`; the other prompts complete.
Per-step records (`llm.stats`) are on by default; `LLM(..., record_stats=False)` turns
them off. `async_scheduling` (default: on a GPU) launches the next decode step before the
current one's tokens reach the host.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence as Seq

from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = "embedded", record_stats: bool = True,
                 async_scheduling: bool | None = None, **kwargs):
        from atom.config import Config
        from atom.model_engine.llm_engine import LLMEngine
        known = {f.name for f in dataclasses.fields(Config) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown keyword argument(s) {unknown}: "
                            f"valid ones are the fields of atom.Config")
        self.config = Config(model=model, **kwargs)
        self.engine = LLMEngine(self.config, record_stats=record_stats, async_scheduling=async_scheduling)
        self.tokenizer = self.engine.tokenizer

    @property
    def stats(self):
        """Per-step and per-request records (`.steps()`, `.requests()` DataFrames)."""
        return self.engine.stats

    def __repr__(self) -> str:
        return f"LLM({self.config.model!r}, {self.engine!r})"

    def start_profile(self) -> None:
        """Start the torch profiler; traces go to `torch_profiler_dir` (see the guide)."""
        self.engine.runner.start_profile()

    def stop_profile(self) -> None:
        self.engine.runner.stop_profile()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} "
                             "prompts: pass one SamplingParams or one per prompt")
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
            try:
                rid = engine.add_request(p, sp)
            except (ValueError, TypeError) as e:
                rid = f"error-{i}"
                logger.warning("request %d refused: %s", i, e)
                ids = p if isinstance(p, list) else []
                results[rid] = RequestOutput(rid, p if isinstance(p, str) else None, list(ids),
                                             finish_reason="error", error=str(e))
            order.append(rid)
        pending = len(order) - len(results)
        bar = _progress(pending, use_tqdm)
        try:
            while not engine.is_finished():
                for out in engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        finally:
            bar.close()
        return [results[rid] for rid in order]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Chat conversations through the model's chat template, then `generate`."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer with a chat template; this model has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Generating", unit="req", disable=not enabled or total == 0,
                dynamic_ncols=True)
