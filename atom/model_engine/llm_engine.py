"""`LLMEngine`: requests in, tokens out, one `step()` at a time.

    engine = LLMEngine(config)
    rid = engine.add_request("Hello", SamplingParams(max_tokens=8))
    while not engine.is_finished():
        for out in engine.step(): print(out.new_text, end="")   # streamed

A step: (proposer: draft tokens) -> schedule -> launch the model -> advance sequences ->
(look-ahead: schedule and launch the next decode step, its input tokens fed on the device)
-> wait for the sampled tokens -> verify drafts, check stops -> detokenize -> outputs.
With `async_scheduling` (on by default on a GPU) the host work of step N+1 overlaps the
device running step N; steps with drafts, and engines with a proposer, skip the look-ahead.

Outputs: `step()` returns a `RequestOutput` for every request that got tokens in the step
(`new_token_ids`, `new_text`; `finished` False) and then one for every request that
finished (`finished` True, the whole `text` / `token_ids`). What a request's outputs hold
is its `RequestOutputKind` (`set_output_kind`, else `default_output_kind`, CUMULATIVE):
FINAL_ONLY requests get only the final output and are not detokenized per step.
A request that cannot be served is refused in `add_request` with a ValueError that says
why; nothing of it reaches the scheduler, so other requests never notice.

`SamplingParams.n > 1`: the request runs as n sequences (child i with `seed + i` when
seeded) sharing the prompt's KV blocks (see `Scheduler`); streamed outputs come per child
(`outputs[0].index`), the final one holds the n completions in index order.
Logprobs (when asked) come back from the runner after `collect` and are kept per sequence
in vLLM's form (`{token_id: Logprob}`, decoded tokens included).
"""
from __future__ import annotations

import dataclasses
import logging
import time

from atom.model_engine.block_manager import BlockManager
from atom.model_engine.detokenizer import detokenize_incrementally, find_stop_string, stream_text
from atom.hf_config import _max_positions
from atom.model_engine.model_runner import ModelRunner
from atom.model_engine.prompts import as_sampling_params, parse_prompt
from atom.model_engine.supported import check_supported
from atom.model_engine.scheduler import Scheduler, eos_token_ids
from atom.model_engine.sequence import Sequence
from atom.model_engine.stats import EngineStats
from atom.model_engine.proposer import Proposer
from atom.model_ops.logprobs import logprob_dict
from atom.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
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
                 record_stats: bool = True, async_scheduling: bool | None = None,
                 proposer: Proposer | None = None,
                 default_output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                 record_expert_load: bool = False, moe_group=None):
        """`moe_group`: under `enable_dp_attention`, the data-parallel replicas' group (an
        engine of a replica, `atom.distributed.data_parallel`, which steps it in lockstep)."""
        check_supported(config, model_runner.device if model_runner is not None else None)
        if getattr(config, "enable_dp_attention", False) and model_runner is None and moe_group is None:
            raise ValueError("enable_dp_attention=True runs in the replicas of a data-parallel engine: "
                             "use LLM(..., data_parallel_size=N, enable_dp_attention=True)")
        self.config = config
        self.executor = None  # tensor parallel: the workers of ranks 1.. (atom.distributed)
        if model_runner is None and config.tensor_parallel_size > 1:
            from atom.distributed.executor import TensorParallelExecutor
            self.executor = TensorParallelExecutor(config)
            model_runner = self.executor.runner
        self.runner = model_runner or ModelRunner(config, moe_group=moe_group)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        self.block_manager = BlockManager(self.runner.num_blocks, config.kv_cache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler.from_config(config, self.block_manager)
        self.scheduler.eos_token_ids = eos_token_ids(config)
        self.vocab_size = config.hf_config.vocab_size
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its n sequences
        # overlap: launch decode step N+1 before step N's tokens reach the host (GPU default)
        self.async_scheduling = (self.runner.device.type == "cuda" if async_scheduling is None
                                 else async_scheduling)
        if self.async_scheduling and self.runner.parallel.world_size > 1:
            if async_scheduling:
                logger.warning("async_scheduling is off under tensor parallel (each step's tokens reach "
                               "the workers with the next step)")
            self.async_scheduling = False
        self._ahead = None  # (batch, handle) of a launched look-ahead step
        self.num_lookahead_steps = 0
        self.proposer = proposer  # draft tokens for multi-token steps; None: one token a step
        self.default_output_kind = default_output_kind  # for requests without their own
        self.stats = EngineStats(record_stats, config.enable_log_stats, config.throughput_log_interval,
                                 config.cache_hit_rate_window,
                                 log_cache_stats=config.enable_prefix_caching)
        if record_expert_load:
            self.record_expert_load(True)

    def record_expert_load(self, on: bool = True) -> None:
        """Routing statistics: tokens per expert per MoE layer in every step, in
        `stats.expert_load()` (ValueError for a model without MoE layers)."""
        self.runner.record_expert_load(on)

    def __repr__(self) -> str:
        return f"LLMEngine({self.runner!r}, {self.scheduler!r}, {self.block_manager!r})"

    def shutdown(self) -> None:
        """Stop and reap the tensor-parallel workers (also done when the engine is collected
        and at exit); a no-op for a one-rank engine."""
        if self.executor is not None:
            self.executor.shutdown()

    # --- requests --------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise TypeError(f"tokenize() takes a string, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("prompt is text but the model has no tokenizer: pass token ids")
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt, sampling_params: SamplingParams | dict | None = None,
                    request_id: str | None = None) -> str:
        """`prompt`: text, token ids (list, tuple, numpy array, torch tensor) or a vLLM-style
        dict, see `atom.model_engine.prompts`; `sampling_params`: SamplingParams or a dict."""
        sp = SamplingParams() if sampling_params is None else as_sampling_params(sampling_params)
        sp.__post_init__()  # re-validate: fields may have been changed after construction
        p = parse_prompt(prompt)
        text, ids = p.text, p.token_ids
        if ids is None:
            if not text:
                raise ValueError("prompt='' is invalid: a prompt needs at least one token")
            ids = self.tokenize(text)
        else:
            bad = ids and (min(ids) < 0 or max(ids) >= self.vocab_size) and [
                t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are invalid: ids must be ints in "
                                 f"[0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            limit = _max_positions(self.config.hf_config)
            if limit is not None and max_len >= limit:
                fix = (f"that is the model's own limit (max_position_embeddings={limit}): "
                       "only a shorter prompt helps")
            else:
                fix = "shorten the prompt or raise max_model_len" + (
                    f" (the model allows up to {limit})" if limit is not None else "")
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={max_len} leaves no room "
                             f"for output: {fix}")
        blocks = -(-(len(ids) + 1) // self.block_manager.block_size)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"prompt needs {blocks} KV blocks but the cache has "
                             f"{self.block_manager.num_blocks}: raise num_kvcache_blocks")
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        seqs = [Sequence(ids, sp if sp.n == 1 else _child_params(sp, 0), request_id=request_id, prompt=text)]
        for i in range(1, sp.n):  # wait for the first one's prompt K/V (Scheduler._fork)
            seqs.append(Sequence(ids, _child_params(sp, i), request_id=seqs[0].request_id, prompt=text))
            seqs[-1].index = i
        seqs[0].forks = seqs[1:]
        self.scheduler.add(seqs[0])
        self.requests[seqs[0].request_id] = seqs
        return seqs[0].request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return None
        for seq in seqs:  # the first one first: it aborts its siblings not forked yet
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            self.runner.release(seq)
        return self._output(seqs, seqs)

    def set_output_kind(self, request_id: str, kind: RequestOutputKind) -> None:
        """What the request's outputs carry (`atom.outputs.RequestOutputKind`); set it right
        after `add_request`, before the request's first step."""
        if not isinstance(kind, RequestOutputKind):
            raise TypeError(f"output kind must be a RequestOutputKind, got {kind!r}")
        seqs = self.requests.get(request_id)
        if seqs is None:
            raise ValueError(f"request_id={request_id!r} is not in the engine")
        for seq in seqs:
            seq.output_kind = kind

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def has_unfinished_requests(self) -> bool:
        return not self.is_finished()

    # --- one step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs of the requests that got tokens in it
        (streamed kinds) and then those of the requests that finished in it."""
        bm = self.block_manager
        hits0, queries0 = bm.num_hit_tokens, bm.num_query_tokens
        t0 = time.perf_counter()
        if self._ahead is not None:  # launched during the previous step
            (batch, handle), self._ahead = self._ahead, None
            t1 = t0
        else:
            if self.proposer is not None:
                self._propose()
            batch = self.scheduler.schedule()
            if not batch:  # nothing ran; a request may have been finished while scheduling
                done, self.scheduler.finished_outside_step = self.scheduler.finished_outside_step, []
                return [self._finish(seq) for seq in done]
            t1 = time.perf_counter()
            handle = self.runner.launch(batch)
        prefill_tokens, decode_tokens = batch.num_prefill_tokens, batch.num_decode_tokens
        chunks = [n for n in batch.num_new_tokens if n > 1]
        self.scheduler.advance(batch)
        # enqueue the next decode step before waiting for this one; not with a proposer, whose
        # drafts need this step's tokens on the host (nor after a step with drafts)
        if self.async_scheduling and self.proposer is None:
            nxt = self.scheduler.schedule_lookahead(batch)
            if nxt is not None:
                self._ahead = (nxt, self.runner.launch(nxt, prev=handle))
                self.num_lookahead_steps += 1
        sampled = self.runner.collect(handle)
        t2 = time.perf_counter()
        self.scheduler.note_step_latency(batch, t2 - t1)
        finished = self.scheduler.commit(batch, sampled)
        if handle.logprobs is not None:
            self._keep_logprobs(batch, handle.logprobs)
        outputs = self._step_outputs(batch, finished)
        t3 = time.perf_counter()
        self.stats.record_step({
            **handle.timing, "post_s": t3 - t2,
            "time": t0, "latency": time.perf_counter() - t0, "schedule_s": t1 - t0, "run_s": t2 - t1,
            "num_seqs": len(batch), "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens,
            "num_sampled": sum(map(len, batch.accepted)), "chunk_sizes": chunks,
            "kv_usage": bm.usage, "prefix_hit_tokens": bm.num_hit_tokens - hits0,
            "prefix_query_tokens": bm.num_query_tokens - queries0,
            "preemptions": batch.num_preempted, "graph_size": handle.graph_size,
            "mixed_graph_tokens": handle.mixed_graph,
        })
        if handle.expert_counts is not None:
            self.stats.record_expert_load(self.stats.num_steps, handle.expert_layers, handle.expert_counts)
        self.stats.maybe_log(len(self.scheduler.running), len(self.scheduler.waiting), bm.usage,
                             prefix_cache=(bm.num_hit_tokens, bm.num_query_tokens))
        return outputs

    def _propose(self) -> None:
        """Ask the proposer for drafts for the running sequences that decode next."""
        seqs = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
        if seqs:
            for seq, drafts in zip(seqs, self.proposer.propose(seqs)):
                seq.draft_token_ids = list(drafts)

    def _step_outputs(self, batch, finished: list[Sequence]) -> list[RequestOutput]:
        """Stop strings, then outputs: one per streamed request that got tokens and is still
        running, then one per finished request. A stop string completed by a step's tokens
        wins over a length / EOS finish of the same step (finish_reason "stop", text cut).
        FINAL_ONLY requests without stop strings cost one check here."""
        tokenizer, default = self.tokenizer, self.default_output_kind
        final_only = RequestOutputKind.FINAL_ONLY
        outputs = []
        for seq, new in zip(batch.seqs, batch.accepted):
            if not new:
                continue
            stops = seq.sampling_params.stop_strings
            kind = seq.output_kind or default
            if kind is final_only and not stops:
                continue
            if tokenizer is not None:
                text = detokenize_incrementally(tokenizer, seq)
                # as vLLM: stop strings count once more than min_tokens tokens were generated
                stop = (stops and seq.num_output_tokens > seq.sampling_params.min_tokens
                        and find_stop_string(seq, text, stops))
                if stop:
                    seq.stopped_by_string = True
                    seq.stop_reason = stop
                    if len(new) > 1:
                        self._drop_after_stop_string(seq, len(new), stops)
                    if seq.is_finished:  # by length or EOS in this very step
                        seq.finish_reason = "stop"
                    else:
                        self.scheduler.finish(seq, "stop")
                        finished.append(seq)
            if kind is not final_only and not seq.is_finished:
                outputs.append(self._output(self.requests.get(seq.request_id, [seq]), [seq], kind))
        outputs += [out for out in map(self._finish, finished) if out is not None]
        return outputs

    def _drop_after_stop_string(self, seq: Sequence, num_new: int, stops: list[str]) -> None:
        """A multi-token step completed a stop string: drop the step's tokens after the one
        that completed it, as a step of one token at a time would have (rare: decodes the
        output once per candidate)."""
        out = seq.output_token_ids
        base = len(out) - num_new
        for m in range(1, num_new):
            text = self.tokenizer.decode(out[:base + m], skip_special_tokens=True)
            if any(stop in text for stop in stops):
                del seq.token_ids[len(seq.token_ids) - (num_new - m):]
                del seq.logprobs[seq.num_output_tokens:], seq.token_logprobs[seq.num_output_tokens:]
                return

    def _keep_logprobs(self, batch, step) -> None:
        """The step's logprobs into each sequence, in vLLM's form: those of the tokens it kept
        (drafts past the first mismatch and tokens past a stop are dropped) and of the prompt
        tokens not known yet."""
        decode = self._decode_tokens if self.tokenizer is not None else None
        sample, prompt = step.sample, step.prompt or {}
        for r, (seq, kept) in enumerate(zip(batch.seqs, batch.accepted)):
            if sample is not None and sample[r] and kept:
                rows = sample[r][:len(kept)]
                seq.logprobs += [logprob_dict(row, decode) for row in rows]
                seq.token_logprobs += [row.logprob for row in rows]
            if r in prompt:
                first, rows = prompt[r]
                skip = len(seq.prompt_logprobs) - (first - 1)  # entry i scores prompt token i + 1
                if skip >= 0:
                    seq.prompt_logprobs += [logprob_dict(row, decode) for row in rows[skip:]]

    def _decode_tokens(self, ids: list[int]) -> list[str]:
        return self.tokenizer.batch_decode([[i] for i in ids])

    def _finish(self, seq: Sequence) -> RequestOutput | None:
        """A sequence finished: its stats row; the request's final output once all its
        sequences did (before that, a streamed one for this completion, or None)."""
        seqs = self.requests.get(seq.request_id)
        self.runner.release(seq)
        _, _, ttft, tpot = _timing([seq])
        self.stats.record_request({
            "request_id": seq.request_id, "prompt_tokens": seq.num_prompt_tokens,
            "output_tokens": seq.num_output_tokens, "cached_tokens": seq.num_cached_tokens,
            "preemptions": seq.num_preemptions, "ttft": ttft, "tpot": tpot,
            "e2e": (seq.finish_time or time.perf_counter()) - seq.arrival_time,
            "finish_reason": seq.finish_reason,
        }, seq.num_cached_tokens, self.block_manager.cacheable_tokens(seq.num_prompt_tokens))
        if seqs is None:  # a sibling finishing in the same step sent the request's final output
            return None
        if all(s.is_finished for s in seqs):
            self.requests.pop(seq.request_id, None)
            return self._output(seqs, seqs)
        if (seq.output_kind or self.default_output_kind) is RequestOutputKind.FINAL_ONLY:
            return None
        return self._output(seqs, [seq])

    def _output(self, seqs: Sequence | list[Sequence], which: list[Sequence] | None = None,
                kind: RequestOutputKind | None = None) -> RequestOutput:
        """The request's output now (`seqs`: its sequences, or the one): a completion for each of
        `which` (default: all), final (`finished`) once every sequence finished."""
        seqs = [seqs] if isinstance(seqs, Sequence) else seqs
        head = seqs[0]
        done = all(s.is_finished for s in seqs)
        first, last, ttft, tpot = _timing(seqs)
        scheduled = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
        metrics = RequestMetrics(head.arrival_time, min(scheduled) if scheduled else None, first,
                                 last if done else None, ttft, tpot)
        plp = None
        if head.sampling_params.prompt_logprobs is not None:
            plp = [None] + head.prompt_logprobs
        return RequestOutput(head.request_id, head.prompt, head.prompt_token_ids,
                             [self._completion(s, kind) for s in (which or seqs)], done,
                             prompt_logprobs=plp, num_cached_tokens=head.num_cached_tokens, metrics=metrics)

    def _completion(self, seq: Sequence, kind: RequestOutputKind | None = None) -> CompletionOutput:
        """A sequence's completion now: final once it finished, else a streamed one of `kind`.
        `new_token_ids` / `new_text` are what its previous outputs did not carry yet."""
        start = seq.num_prompt_tokens + seq.num_streamed_tokens
        end = seq.num_tokens - seq.num_pending - seq.num_draft_tokens
        new_ids = seq.token_ids[start:end]
        begin = 0  # first generated token of this output (DELTA: only the new ones)
        seq.num_streamed_tokens = end - seq.num_prompt_tokens
        if seq.is_finished:
            if seq.stopped_by_string or self.tokenizer is None:
                final = seq.output_text
            else:
                final = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            text, new_text = stream_text(seq, final)
            ids = seq.output_token_ids
        else:
            text, new_text = stream_text(seq)
            if (kind or seq.output_kind or self.default_output_kind) is RequestOutputKind.DELTA:
                text, ids = new_text, new_ids
                begin = start - seq.num_prompt_tokens
            else:
                ids = seq.output_token_ids
        logprobs = cumulative = None
        if seq.sampling_params.logprobs is not None:
            logprobs = seq.logprobs[begin:begin + len(ids)]
            cumulative = sum(seq.token_logprobs[:end - seq.num_prompt_tokens])
        return CompletionOutput(seq.index, text, ids, cumulative, logprobs, seq.finish_reason,
                                seq.stop_reason, new_token_ids=new_ids, new_text=new_text)


def _child_params(sp: SamplingParams, i: int) -> SamplingParams:
    """Completion i of an n > 1 request: its own random stream (seed + i, as vLLM); prompt
    logprobs only once, on the first."""
    return dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i,
                               prompt_logprobs=sp.prompt_logprobs if i == 0 else None)


def _timing(seqs: list[Sequence]) -> tuple[float | None, float | None, float | None, float | None]:
    """(first token time, last finish time, ttft, tpot) over a request's sequences; tpot once all
    finished: seconds per output token after the first, of the longest completion."""
    firsts = [s.first_token_time for s in seqs if s.first_token_time]
    first = min(firsts) if firsts else None
    ends = [s.finish_time for s in seqs]
    last = max(ends) if all(ends) else None
    ttft = first - seqs[0].arrival_time if first else None
    longest = max(s.num_output_tokens for s in seqs)
    tpot = (last - first) / (longest - 1) if first and last and longest > 1 else None
    return first, last, ttft, tpot
