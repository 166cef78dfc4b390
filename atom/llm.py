"""`LLM`: the façade. Builds a `Config` from keywords and wires the engine.

    llm = LLM("path/to/model", max_num_seqs=64, dtype="bfloat16", seed=0)
    outs = llm.generate(["Hello", "Hi"], SamplingParams(temperature=0, max_tokens=16))

`generate` returns one `RequestOutput` per prompt, in input order. Prompts are text, token
ids (list, tuple, numpy array, torch tensor) or vLLM-style dicts (`{"prompt": ...}`,
`{"prompt_token_ids": [...]}`), one or a list of them (`atom.model_engine.prompts`);
`sampling_params` is one `SamplingParams` (or a dict of its fields) or one per prompt.
A prompt that cannot be served (empty, too long, bad token ids, bad sampling parameters)
comes back with `finish_reason="error"` and the reason in `.error`; the other prompts
complete. An exception that escapes the step loop (a KeyboardInterrupt in a notebook)
aborts the call's requests, freeing their KV blocks, before it propagates.

Keywords besides `Config`'s fields: `dtype` ("auto": the checkpoint's; "bfloat16",
"float16", "float32" or a torch.dtype), `seed` (seeds random / numpy / torch once, here),
`record_stats` (per-step records, `llm.stats`; on by default; not under data parallel), `stats_window` (how many
step and request records are kept, default 10,000; None: all), `record_expert_load`
(MoE models: tokens per expert per layer per step, `llm.stats.expert_load()`), `async_scheduling`
(default: on a GPU) launches the next decode step before the current one's tokens reach
the host. `asyncio_mode=True` is refused here (it is the server's engine loop,
`AsyncLLMEngine`). Building an `LLM` makes ATOM's INFO lines (engine-status line included) visible
on stderr unless logging is configured already (`atom.utils.log_setup`).

`tensor_parallel_size > 1` spawns one worker process per extra rank
(`atom.distributed.executor`); `data_parallel_size > 1` (or `parallel_config=
{"data_parallel_size": ...}`, with the other ParallelConfig fields) runs that many engine
replicas in their own processes behind a router (`atom.distributed.data_parallel`).
`llm.shutdown()` (or `with LLM(...) as llm:`) reaps them; so do collection and exit.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from atom.model_engine.prompts import as_sampling_params, parse_prompt, split_prompts
from atom.model_engine.stats import DEFAULT_WINDOW, check_window
from atom.outputs import RequestOutput, RequestOutputKind
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str = "embedded", record_stats: bool = True,
                 async_scheduling: bool | None = None, dtype: Any = "auto", seed: int | None = None,
                 stats_window: int | None = DEFAULT_WINDOW, record_expert_load: bool = False, **kwargs):
        from atom.config import Config
        from atom.model_engine.llm_engine import LLMEngine
        from atom.utils.dtypes import parse_dtype
        from atom.utils.log_setup import ensure_visible
        from atom.utils.seed import check_seed, set_seed
        if "data_parallel_size" in kwargs:  # vLLM's spelling: into parallel_config
            kwargs["parallel_config"] = _with_dp_size(kwargs.get("parallel_config"), kwargs.pop("data_parallel_size"))
        known = {f.name for f in dataclasses.fields(Config) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown keyword argument(s) {unknown}: "
                            f"valid ones are the fields of atom.Config, dtype, seed, record_stats, "
                            f"stats_window, record_expert_load and async_scheduling")
        if kwargs.get("asyncio_mode"):
            raise ValueError("asyncio_mode=True is invalid for LLM, which steps its engine itself: "
                             "use atom.model_engine.async_engine.AsyncLLMEngine or the server "
                             "(python -m atom.entrypoints.openai_server), whose engine loop it is")
        forced_dtype = parse_dtype(dtype)
        check_seed(seed)
        check_window(stats_window)
        ensure_visible()
        self.config = Config(model=model, **kwargs)
        if forced_dtype is not None and forced_dtype != self.config.torch_dtype:
            logger.info("dtype=%s overrides the checkpoint's %s", forced_dtype, self.config.torch_dtype)
            self.config.torch_dtype = forced_dtype
        self.seed = set_seed(seed)
        if self.config.parallel_config.data_parallel_size > 1:  # replicas in their own processes
            from atom.distributed.data_parallel import DataParallelEngine
            for name, value, default in (("record_expert_load", record_expert_load, False), ("seed", seed, None),
                                         ("async_scheduling", async_scheduling, None)):
                if value != default:  # the replicas' engines are built in their processes without them
                    raise ValueError(f"{name}={value!r} is not implemented with data_parallel_size="
                                     f"{self.config.parallel_config.data_parallel_size} yet: leave it {default!r}")
            self.engine = DataParallelEngine(self.config)
        else:
            self.engine = LLMEngine(self.config, record_stats=record_stats, async_scheduling=async_scheduling,
                                    record_expert_load=record_expert_load)
        self.engine.stats.set_window(stats_window)
        self.tokenizer = self.engine.tokenizer

    @property
    def stats(self):
        """Per-step and per-request records (`.steps()`, `.requests()` DataFrames)."""
        return self.engine.stats

    def __repr__(self) -> str:
        return f"LLM({self.config.model!r}, {self.engine!r})"

    def shutdown(self) -> None:
        """Stop and reap the engine's worker processes (tensor / data parallel); also done
        when the LLM is collected and at exit."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _profiled_runner(self, what: str):
        if not hasattr(self.engine, "runner"):
            raise NotImplementedError(f"{what}() profiles one engine's runner; under data_parallel_size > 1 "
                                      "the replicas run in their own processes")
        if self.config.tensor_parallel_size > 1:
            logger.warning("%s(): only rank 0's runner is profiled (tensor_parallel_size=%d)", what,
                           self.config.tensor_parallel_size)
        return self.engine.runner

    def start_profile(self) -> None:
        """Start the torch profiler; traces go to `torch_profiler_dir` (see the guide)."""
        self._profiled_runner("start_profile").start_profile()

    def stop_profile(self) -> None:
        self._profiled_runner("stop_profile").stop_profile()

    def generate(self, prompts, sampling_params: Any = None, use_tqdm: bool = True) -> list[RequestOutput]:
        items = split_prompts(prompts)
        sps = _sampling_list(sampling_params, len(items))
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        added: list[str] = []
        bar = None
        try:
            for i, (p, sp) in enumerate(zip(items, sps)):
                parsed = None
                try:
                    parsed = parse_prompt(p, f"prompts[{i}]")
                    rid = engine.add_request(parsed, sp)
                    engine.set_output_kind(rid, RequestOutputKind.FINAL_ONLY)  # no per-step text
                    added.append(rid)
                except (ValueError, TypeError) as e:
                    rid = f"error-{i}"
                    logger.warning("request %d refused: %s", i, e)
                    results[rid] = RequestOutput(rid, parsed.text if parsed else None,
                                                 list(parsed.token_ids or []) if parsed else [],
                                                 finish_reason="error", error=str(e))
                order.append(rid)
            pending = set(added)
            bar = _progress(len(pending), use_tqdm)
            while pending and not engine.is_finished():
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:  # KeyboardInterrupt, a failing step: leave the engine clean
            _abort_unfinished(engine, [rid for rid in added if rid not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] if rid in results else RequestOutput(rid, None, [], finish_reason="abort")
                for rid in order]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: Any = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Chat conversations through the model's chat template, then `generate`."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer with a chat template; this model has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)


def _with_dp_size(parallel_config: Any, size: Any):
    """`parallel_config` (None, a dict or a ParallelConfig) with data_parallel_size = `size`."""
    from atom.config import ParallelConfig
    if parallel_config is None:
        return {"data_parallel_size": size}
    if isinstance(parallel_config, dict):
        return {**parallel_config, "data_parallel_size": size}
    if isinstance(parallel_config, ParallelConfig):
        local = parallel_config.data_parallel_size_local  # defaulted to the old size: default again
        local = None if local == parallel_config.data_parallel_size else local
        return dataclasses.replace(parallel_config, data_parallel_size=size, data_parallel_size_local=local)
    return parallel_config  # Config names the bad type


def _sampling_list(sampling_params: Any, n: int) -> list[SamplingParams]:
    """One SamplingParams (or dict) for all prompts, or one per prompt."""
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, (SamplingParams, dict)):
        return [as_sampling_params(sampling_params)] * n
    if not isinstance(sampling_params, (list, tuple)):
        return [as_sampling_params(sampling_params)] * n  # raises the TypeError
    if len(sampling_params) != n:
        raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} "
                         "prompts: pass one SamplingParams or one per prompt")
    return [as_sampling_params(sp, f"sampling_params[{i}]") for i, sp in enumerate(sampling_params)]


def _abort_unfinished(engine, request_ids: list[str]) -> None:
    for rid in request_ids:
        try:
            engine.abort(rid)
        except Exception:  # keep aborting the others; the original exception propagates
            logger.exception("could not abort request %s", rid)
    if request_ids:
        logger.warning("generate interrupted: aborted %d unfinished request(s)", len(request_ids))


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Generating", unit="req", disable=not enabled or total == 0,
                dynamic_ncols=True)
