"""`LLMEngine`: requests in, tokens out, one `step()` at a time.

    engine = LLMEngine(config)
    rid = engine.add_request("Hello", SamplingParams(max_tokens=8))
    while not engine.is_finished():
        for out in engine.step(): print(out.text)

A step: schedule -> launch the model -> advance sequences -> (look-ahead: schedule and
launch the next decode step, its input tokens fed on the device) -> wait for the sampled
tokens -> check stops -> detokenize. With `async_scheduling` (on by default on a GPU) the
host work of step N+1 overlaps the device running step N.
A request that cannot be served is refused in `add_request` with a ValueError that says
why; nothing of it reaches the scheduler, so other requests never notice.
"""
from __future__ import annotations

import logging
import time

from atom.model_engine.block_manager import BlockManager
from atom.model_engine.detokenizer import detokenize_incrementally, find_stop_string
from atom.model_engine.model_runner import ModelRunner
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import Sequence
from atom.model_engine.stats import EngineStats
from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def load_tokenizer(path: str):
    """The model folder's tokenizer, or None when it has none (dummy-weight configs)."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        logger.warning("no tokenizer in %s (%s): prompts must be token ids", path, type(e).__name__)
        return None


class LLMEngine:
    def __init__(self, config, model_runner: ModelRunner | None = None, tokenizer=None,
                 record_stats: bool = True, async_scheduling: bool | None = None):
        self.config = config
        self.runner = model_runner or ModelRunner(config)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        self.block_manager = BlockManager(self.runner.num_blocks, config.kv_cache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler.from_config(config, self.block_manager)
        eos = {config.eos_token_id} if config.eos_token_id is not None and config.eos_token_id >= 0 else set()
        self.scheduler.eos_token_ids = frozenset(eos | set(config.stop_token_ids or []))
        self.vocab_size = config.hf_config.vocab_size
        self.requests: dict[str, Sequence] = {}
        # overlap: launch decode step N+1 before step N's tokens reach the host (GPU default)
        self.async_scheduling = (self.runner.device.type == "cuda" if async_scheduling is None
                                 else async_scheduling)
        self._ahead = None  # (batch, handle) of a launched look-ahead step
        self.num_lookahead_steps = 0
        self.stats = EngineStats(record_stats, config.enable_log_stats, config.throughput_log_interval,
                                 config.cache_hit_rate_window)

    def __repr__(self) -> str:
        return f"LLMEngine({self.runner!r}, {self.scheduler!r}, {self.block_manager!r})"

    # --- requests --------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt is text but the model has no tokenizer: pass token ids")
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        sp.__post_init__()  # re-validate: fields may have been changed after construction
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt='' is invalid: a prompt needs at least one token")
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = None, list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are invalid: ids must be ints in "
                                 f"[0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={max_len} leaves no room "
                             "for output: shorten the prompt or raise max_model_len")
        blocks = -(-(len(ids) + 1) // self.block_manager.block_size)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"prompt needs {blocks} KV blocks but the cache has "
                             f"{self.block_manager.num_blocks}: raise num_kvcache_blocks")
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        seq = Sequence(ids, sp, request_id=request_id, prompt=text)
        self.scheduler.add(seq)
        self.requests[seq.request_id] = seq
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        self.runner.release(seq)
        return self._output(seq)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def has_unfinished_requests(self) -> bool:
        return not self.is_finished()

    # --- one step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests that finished in it."""
        bm = self.block_manager
        hits0, queries0 = bm.num_hit_tokens, bm.num_query_tokens
        t0 = time.perf_counter()
        if self._ahead is not None:  # launched during the previous step
            (batch, handle), self._ahead = self._ahead, None
            t1 = t0
        else:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            t1 = time.perf_counter()
            handle = self.runner.launch(batch)
        prefill_tokens, decode_tokens = batch.num_prefill_tokens, batch.num_decode_tokens
        chunks = [n for n in batch.num_new_tokens if n > 1]
        self.scheduler.advance(batch)
        if self.async_scheduling:  # enqueue the next decode step before waiting for this one
            nxt = self.scheduler.schedule_lookahead(batch)
            if nxt is not None:
                self._ahead = (nxt, self.runner.launch(nxt, prev=handle))
                self.num_lookahead_steps += 1
        sampled = self.runner.collect(handle)
        t2 = time.perf_counter()
        self.scheduler.note_step_latency(batch, t2 - t1)
        finished = self.scheduler.commit(batch, sampled)
        for seq, tok in zip(batch.seqs, sampled):
            if tok is None or seq.is_finished:
                continue
            stops = seq.sampling_params.stop_strings
            if stops and self.tokenizer is not None:
                new = detokenize_incrementally(self.tokenizer, seq)
                if find_stop_string(seq, new, stops):
                    self.scheduler.finish(seq, "stop")
                    seq.stopped_by_string = True
                    finished.append(seq)
        outputs = [self._finish(seq) for seq in finished]
        t3 = time.perf_counter()
        self.stats.record_step({
            **handle.timing, "post_s": t3 - t2,
            "time": t0, "latency": time.perf_counter() - t0, "schedule_s": t1 - t0, "run_s": t2 - t1,
            "num_seqs": len(batch), "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens,
            "num_sampled": sum(t is not None for t in sampled), "chunk_sizes": chunks,
            "kv_usage": bm.usage, "prefix_hit_tokens": bm.num_hit_tokens - hits0,
            "prefix_query_tokens": bm.num_query_tokens - queries0,
            "preemptions": batch.num_preempted, "graph_size": handle.graph_size,
        })
        self.stats.maybe_log(len(self.scheduler.running), len(self.scheduler.waiting), bm.usage)
        return outputs

    def _finish(self, seq: Sequence) -> RequestOutput:
        self.requests.pop(seq.request_id, None)
        self.runner.release(seq)
        out = self._output(seq)
        self.stats.record_request({
            "request_id": seq.request_id, "prompt_tokens": seq.num_prompt_tokens,
            "output_tokens": seq.num_output_tokens, "cached_tokens": seq.num_cached_tokens,
            "preemptions": seq.num_preemptions, "ttft": out.ttft, "tpot": out.tpot,
            "e2e": (seq.finish_time or time.perf_counter()) - seq.arrival_time,
            "finish_reason": seq.finish_reason,
        }, seq.num_cached_tokens, self.block_manager.cacheable_tokens(seq.num_prompt_tokens))
        return out

    def _output(self, seq: Sequence) -> RequestOutput:
        if seq.stopped_by_string or self.tokenizer is None:
            text = seq.output_text
        else:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time else None
        tpot = None
        if seq.first_token_time and seq.finish_time and seq.num_output_tokens > 1:
            tpot = (seq.finish_time - seq.first_token_time) / (seq.num_output_tokens - 1)
        return RequestOutput(seq.request_id, seq.prompt, seq.token_ids[:seq.num_prompt_tokens], text,
                             list(seq.output_token_ids), seq.finish_reason, seq.num_cached_tokens, ttft, tpot)
