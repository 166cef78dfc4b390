"""Run a recipe: build the engine it names, run its workload, measure, compare, write.

    recipe = find_recipe("smollm2-cpu-quickstart")
    result = run_recipe(recipe, out_dir="out/recipes/smollm2-cpu-quickstart")
    result["status"]            # "pass" or "fail"; result["metrics"], result["checks"]

Refusals are exceptions with a message meant for the user: `RecipePending` (status
pending), `HardwareMismatch` (wrong device), `RecipeError` (invalid file, unknown name,
or an engine/workload error).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from atom.recipes.schema import METRICS, Recipe, RecipeError, load_recipe

logger = logging.getLogger(__name__)


class RecipePending(RecipeError):
    """The recipe is marked `status: pending`: what it needs does not exist yet."""


class HardwareMismatch(RecipeError):
    """This machine is not the hardware the recipe applies to."""


# --- finding recipes -------------------------------------------------------------------
def recipes_dir() -> Path:
    """The repository's `recipes/` folder (else `./recipes`)."""
    here = Path(__file__).resolve().parents[2] / "recipes"
    return here if here.is_dir() else Path.cwd() / "recipes"


def list_recipes(folder: str | os.PathLike | None = None) -> list[Recipe]:
    folder = Path(folder) if folder else recipes_dir()
    return [load_recipe(str(p)) for p in sorted(folder.glob("*.yaml"))]


def find_recipe(name: str, folder: str | os.PathLike | None = None) -> Recipe:
    """A recipe by name (a file of `recipes/`) or by path to its YAML file."""
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        if not os.path.exists(name):
            raise RecipeError(f"recipe file {name} does not exist")
        return load_recipe(name)
    folder = Path(folder) if folder else recipes_dir()
    path = folder / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(p.stem for p in sorted(folder.glob("*.yaml"))) or "none"
        raise RecipeError(f"no recipe named {name!r} in {folder} (known: {known})")
    return load_recipe(str(path))


# --- hardware --------------------------------------------------------------------------
def detect_hardware() -> dict:
    import torch
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return {"device": "cuda", "gpus": n, "name": torch.cuda.get_device_name(0)}
    return {"device": "cpu", "gpus": 0, "name": "CPU"}


def hardware_mismatch(recipe: Recipe, hw: dict | None = None) -> str | None:
    """Why this machine cannot run the recipe, or None when it can."""
    hw = hw or detect_hardware()
    need = recipe.hardware
    if need.device == "cpu":
        return None  # CPU recipes run on the CPU of any machine
    want = f"{need.device} with {need.min_gpus} GPU{'s' if need.min_gpus > 1 else ''}"
    if hw["device"] != "cuda":
        return f"recipe {recipe.name!r} needs {want}; this machine has no GPU (CPU only)"
    if hw["gpus"] < need.min_gpus:
        return f"recipe {recipe.name!r} needs {want}; this machine has {hw['gpus']} ({hw['name']})"
    if need.device == "nvidia-h200" and "H200" not in hw["name"]:
        return f"recipe {recipe.name!r} needs {want}; this machine has {hw['name']}"
    return None


# --- the workload ------------------------------------------------------------------------
@dataclass
class Req:
    prompt: str | list[int]
    sampling: Any  # SamplingParams
    expect_contains: list[str]
    label: str


def _chat_text(tokenizer, user: str, system: str | None) -> str:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return (system + "\n\n" if system else "") + user


def build_requests(recipe: Recipe, tokenizer, vocab_size: int) -> list[Req]:
    """The recipe's requests: prompts (text or token ids) with their sampling parameters."""
    import random

    from atom.benchmarks.workloads import mixed_workload, nano_vllm_workload
    w = recipe.workload
    if w.kind in ("chat",) or (w.kind == "shared-prefix" and w.system_prompt):
        if tokenizer is None:
            raise RecipeError(f"workload.kind={w.kind} with text prompts needs a tokenizer; "
                              f"{recipe.model.label} has none")
    if w.kind == "chat":
        return [Req(_chat_text(tokenizer, p.content, p.system), recipe.sampling_params(), p.expect_contains,
                    p.content) for p in w.prompts]
    if w.kind in ("random", "nano-vllm"):
        reqs = (mixed_workload(w.num_prompts, w.input_len, w.output_len, vocab_size, seed=w.seed)
                if w.kind == "random" else
                nano_vllm_workload(w.num_prompts, w.input_len[1], w.output_len[1], seed=w.seed))
        base = {"ignore_eos": True, **w.sampling}
        return [Req(r.prompt_token_ids, recipe.sampling_params(**{**base, "max_tokens": r.max_tokens}), [],
                    f"{len(r.prompt_token_ids)} tokens") for r in reqs]
    # shared-prefix
    sp = recipe.sampling_params()
    if w.system_prompt:
        qs = [w.questions[i % len(w.questions)] for i in range(w.num_prompts)]
        return [Req(_chat_text(tokenizer, q, w.system_prompt), sp, [], q) for q in qs]
    rng = random.Random(w.seed)
    system = [rng.randint(10, vocab_size - 1) for _ in range(w.system_prompt_len)]
    return [Req(system + [rng.randint(10, vocab_size - 1) for _ in range(rng.randint(*w.question_len))], sp, [],
                f"shared {w.system_prompt_len} + own tokens") for _ in range(w.num_prompts)]


# --- running ---------------------------------------------------------------------------
@dataclass
class RunRecord:
    wall_s: float
    outputs: list
    steps: pd.DataFrame
    requests: pd.DataFrame


def _drive(engine, reqs: list[Req]) -> list:
    from atom.outputs import RequestOutputKind
    ids = [engine.add_request(r.prompt, r.sampling) for r in reqs]
    for rid in ids:
        engine.set_output_kind(rid, RequestOutputKind.FINAL_ONLY)  # finished outputs only
    done = {}
    while not engine.is_finished():
        for out in engine.step():
            done[out.request_id] = out
    return [done[i] for i in ids]


def _run_once(config, runner, tokenizer, reqs: list[Req], prime_first: bool) -> RunRecord:
    from atom.model_engine.llm_engine import LLMEngine
    from atom.viz.frames import requests_frame, steps_frame
    engine = LLMEngine(config, model_runner=runner, tokenizer=tokenizer)  # fresh cache bookkeeping
    t0 = time.perf_counter()
    outs = (_drive(engine, reqs[:1]) + _drive(engine, reqs[1:])) if prime_first and len(reqs) > 1 \
        else _drive(engine, reqs)
    _sync(runner)
    wall = time.perf_counter() - t0
    logger.info("%d requests in %.2f s (prefix caching %s)", len(reqs), wall,
                "on" if config.enable_prefix_caching else "off")
    return RunRecord(wall, outs, steps_frame(engine.stats), requests_frame(engine.stats))


def _sync(runner) -> None:
    import torch
    if getattr(runner, "device", None) is not None and runner.device.type == "cuda":
        torch.cuda.synchronize()


def _model_path(recipe: Recipe) -> str:
    m = recipe.model
    if m.embedded:
        from atom.model_loader.embedded import ensure_embedded_model
        return ensure_embedded_model()
    if m.architecture:
        from atom.benchmarks.workloads import write_model_config
        return write_model_config(m.architecture)
    if not os.path.isdir(m.path):
        raise RecipeError(f"model.path={m.path!r} is not a folder on this machine")
    return m.path


def build_engine_parts(recipe: Recipe):
    """(config, model runner, tokenizer) for the recipe's model and engine arguments."""
    from atom.config import Config
    from atom.model_engine.llm_engine import load_tokenizer
    from atom.model_engine.model_runner import ModelRunner
    kwargs = {"enable_log_stats": False, **recipe.engine}
    if recipe.model.load_dummy and "load_dummy" not in kwargs:
        kwargs["load_dummy"] = recipe.model.load_dummy
    try:
        config = Config(model=_model_path(recipe), **kwargs)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{recipe.source}: engine: {e}") from None
    device = "cpu" if recipe.hardware.device == "cpu" else None
    try:
        runner = ModelRunner(config, device=device)
    except (ValueError, RuntimeError, OSError) as e:
        raise RecipeError(f"{recipe.source}: the model did not load: {type(e).__name__}: {e}") from None
    return config, runner, load_tokenizer(config.model)


def run_recipe(recipe: Recipe, out_dir: str | None = None, force: bool = False) -> dict:
    """Run the recipe and return its result dict (also written to `out_dir` when given)."""
    if recipe.status == "pending":
        raise RecipePending(f"recipe {recipe.name!r} is pending: {recipe.pending_reason}")
    hw = detect_hardware()
    why = hardware_mismatch(recipe, hw)
    if why and not force:
        raise HardwareMismatch(why + ". Run it on matching hardware, or pass --force to run anyway "
                               "(its expected figures still apply).")
    t_start = time.perf_counter()
    config, runner, tokenizer = build_engine_parts(recipe)
    w = recipe.workload
    try:
        reqs = build_requests(recipe, tokenizer, config.hf_config.vocab_size)
        if w.warmup:
            warm = [Req([11 + i, 12 + i, 13 + i, 14 + i] * 4, recipe.sampling_params(max_tokens=4, ignore_eos=True),
                        [], "warm-up") for i in range(2)]
            _run_once(config, runner, tokenizer, warm, False)
        off_cfg = dataclasses.replace(config, enable_prefix_caching=False) \
            if "time_saved_vs_no_prefix_cache" in recipe.metrics else None
        prime = w.kind == "shared-prefix" and w.prime_first
        runs, runs_off = [], []
        for _ in range(w.repeat):
            if off_cfg is not None:
                runs_off.append(_run_once(off_cfg, runner, tokenizer, reqs, prime))
            runs.append(_run_once(config, runner, tokenizer, reqs, prime))
    except (ValueError, RuntimeError) as e:
        raise RecipeError(f"{recipe.source}: the run failed: {type(e).__name__}: {e}") from None
    best = min(runs, key=lambda r: r.wall_s)
    logger.info("recipe %s: best of %d runs %.2f s", recipe.name, len(runs), best.wall_s)
    metrics = compute_metrics(recipe, best, reqs, min(runs_off, key=lambda r: r.wall_s) if runs_off else None)
    result = _result(recipe, hw, metrics, best, reqs, runs, runs_off, time.perf_counter() - t_start)
    if out_dir:
        write_outputs(recipe, result, best, config, out_dir)
    return result


def compute_metrics(recipe: Recipe, run: RunRecord, reqs: list[Req], run_off: RunRecord | None) -> dict:
    steps, rq = run.steps, run.requests
    out_tokens = int(sum(o.num_output_tokens for o in run.outputs))
    m: dict[str, float] = {}
    query = float(steps["prefix_query_tokens"].sum())
    dec = steps[steps["is_decode"]]
    values = {
        "throughput_tok_s": lambda: out_tokens / run.wall_s,
        "output_tokens": lambda: out_tokens,
        "wall_s": lambda: run.wall_s,
        "ttft_ms": lambda: float(rq["ttft_ms"].mean()),
        "tpot_ms": lambda: float(rq["tpot_ms"].mean()),
        "e2e_ms": lambda: float(rq["e2e_ms"].mean()),
        "decode_ms_per_token": lambda: float(dec["latency_ms"].mean()) if len(dec) else float("nan"),
        "prefix_hit_rate": lambda: float(steps["prefix_hit_tokens"].sum()) / query if query else 0.0,
        "time_saved_vs_no_prefix_cache": lambda: 1.0 - run.wall_s / run_off.wall_s,
        "accuracy": lambda: _accuracy(reqs, run.outputs)[0],
        "preemptions": lambda: int(steps["preemptions"].sum()),
    }
    for name in recipe.metrics:
        if name in values:
            m[name] = values[name]()
    if {"roofline_fraction", "roofline_tok_s", "decode_floor_ms"} & set(recipe.metrics):
        from atom.benchmarks.roofline import H200_BANDWIDTH, H200_BF16_FLOPS, decode_floor_ms, workload_floor
        from atom.benchmarks.workloads import MODEL_CONFIGS
        cfg = MODEL_CONFIGS[recipe.model.architecture]
        bw = recipe.roofline.get("bandwidth", H200_BANDWIDTH)
        fl = recipe.roofline.get("flops", H200_BF16_FLOPS)
        plens = [len(o.prompt_token_ids) for o in run.outputs]
        olens = [max(1, o.num_output_tokens) for o in run.outputs]
        floor = workload_floor(cfg, plens, olens, bandwidth=bw, flops=fl)
        if "roofline_tok_s" in recipe.metrics:
            m["roofline_tok_s"] = floor.tokens_per_s
        if "roofline_fraction" in recipe.metrics:
            m["roofline_fraction"] = (out_tokens / run.wall_s) / floor.tokens_per_s
        if "decode_floor_ms" in recipe.metrics:
            ctx = int(sum(p + o / 2 for p, o in zip(plens, olens)) / len(plens))
            m["decode_floor_ms"] = decode_floor_ms(cfg, 1, ctx, bandwidth=bw)
    return {k: m[k] for k in recipe.metrics if k in m}


def _accuracy(reqs: list[Req], outs: list) -> tuple[float, list[dict]]:
    rows, hits, n = [], 0, 0
    for r, o in zip(reqs, outs):
        ok = None
        if r.expect_contains:
            ok = all(x.lower() in (o.text or "").lower() for x in r.expect_contains)
            n += 1
            hits += ok
        rows.append({"prompt": r.label, "text": o.text, "expect_contains": r.expect_contains, "ok": ok})
    return (hits / n if n else float("nan")), rows


def _result(recipe, hw, metrics, best, reqs, runs, runs_off, wall) -> dict:
    checks = []
    for name, exp in recipe.expected.items():
        ok, why = exp.check(metrics.get(name))
        checks.append({"metric": name, "value": metrics.get(name), "expected": exp.to_dict(), "ok": ok, "why": why})
    res = {
        "name": recipe.name, "description": recipe.description,
        "status": "pass" if all(c["ok"] for c in checks) else "fail",
        "model": recipe.model.label, "engine": recipe.engine,
        "hardware": {"required": dataclasses.asdict(recipe.hardware), "found": hw},
        "metrics": metrics, "units": {k: METRICS[k][0] for k in metrics}, "checks": checks,
        "runs_s": [r.wall_s for r in runs], "runs_prefix_off_s": [r.wall_s for r in runs_off],
        "requests": len(reqs), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "total_s": wall,
    }
    if recipe.workload.kind == "chat":
        res["outputs"] = _accuracy(reqs, best.outputs)[1]
    return res


# --- writing ---------------------------------------------------------------------------
def write_outputs(recipe: Recipe, result: dict, run: RunRecord, config, out_dir: str) -> list[str]:
    """results.json, results.md, the run's frames (JSON lines) and its plots."""
    from atom.viz import plots
    from atom.viz.frames import Frames, save_frames
    from atom.viz.tables import recipe_markdown
    os.makedirs(out_dir, exist_ok=True)
    files = save_frames(Frames(run.steps, run.requests, {}), out_dir, meta={"recipe": recipe.name})
    figs = {"chunk_latency": lambda: plots.plot_chunk_latency(run.steps),
            "kv_usage": lambda: plots.plot_kv_usage(run.steps)}
    if config.enable_prefix_caching:
        figs["prefix_cache_hit_rate"] = lambda: plots.plot_prefix_cache_hit_rate(
            run.requests, window=8, block_size=config.kv_cache_block_size)
    if config.capture_sizes and recipe.hardware.device != "cpu":
        figs["graph_capture_sizes"] = lambda: plots.plot_graph_capture_sizes(run.steps, config.capture_sizes)
    m = result["metrics"]
    if "throughput_tok_s" in m and ("roofline_tok_s" in m or "roofline_fraction" in m):
        bound = m.get("roofline_tok_s") or m["throughput_tok_s"] / m["roofline_fraction"]
        figs["roofline"] = lambda: plots.plot_roofline(
            [{"name": recipe.name, "measured": m["throughput_tok_s"], "bound": bound, "unit": "tok/s"}])
    if "decode_floor_ms" in m and "decode_ms_per_token" in m:
        figs["roofline"] = lambda: plots.plot_roofline(
            [{"name": recipe.name, "measured": m["decode_ms_per_token"], "bound": m["decode_floor_ms"],
              "unit": "ms/token"}])
    for name, make in figs.items():
        path = os.path.join(out_dir, f"{name}.png")
        make().savefig(path, dpi=100)
        files.append(path)
    result["plots"] = [os.path.basename(f) for f in files if f.endswith(".png")]
    md, js = os.path.join(out_dir, "results.md"), os.path.join(out_dir, "results.json")
    with open(md, "w") as f:
        f.write(recipe_markdown(result))
    files += [md, js]
    result["files"] = files
    save_result(result, js)
    return files


def save_result(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=lambda x: x.item() if hasattr(x, "item") else str(x))
