"""What a recipe file may say, and the checks that reject anything else.

A recipe is YAML:

    name: smollm2-cpu-quickstart          # must match the file name
    description: ...
    status: ready                         # or pending (+ pending_reason): `run` refuses it
    hardware: {device: cpu}               # cpu | cuda | nvidia-h200, min_gpus
    model: {embedded: true}               # or {path: DIR} or {architecture: qwen3-0.6b}
    engine: {max_model_len: 1024}         # atom.Config keywords
    workload: {kind: chat, prompts: [...], sampling: {temperature: 0, max_tokens: 24}}
    metrics: [throughput_tok_s, accuracy]
    expected: {accuracy: {value: 1.0}, throughput_tok_s: {min: 1}}

Every error is a `RecipeError` naming the file, the field and what is allowed.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from atom.benchmarks.workloads import MODEL_CONFIGS
from atom.sampling_params import SamplingParams

DEVICES = ("cpu", "cuda", "nvidia-h200")
STATUSES = ("ready", "pending")
WORKLOAD_KINDS = ("chat", "random", "nano-vllm", "shared-prefix")

# metric -> (unit, what it is)
METRICS: dict[str, tuple[str, str]] = {
    "throughput_tok_s": ("tok/s", "output tokens / wall time of the measured run"),
    "output_tokens": ("tokens", "output tokens of the measured run"),
    "wall_s": ("s", "wall time of the measured run"),
    "ttft_ms": ("ms", "mean time to first token"),
    "tpot_ms": ("ms", "mean time per output token after the first"),
    "e2e_ms": ("ms", "mean request latency"),
    "decode_ms_per_token": ("ms", "mean latency of decode-only steps (ms/token at batch 1)"),
    "prefix_hit_rate": ("", "prefix-cache hit tokens / looked-up tokens"),
    "time_saved_vs_no_prefix_cache": ("", "1 - wall(prefix caching on) / wall(off), same workload"),
    "accuracy": ("", "fraction of prompts whose answer contains its expect_contains"),
    "roofline_fraction": ("", "measured tok/s / roofline tok/s of the workload"),
    "roofline_tok_s": ("tok/s", "roofline (bytes / bandwidth, FLOPs / peak) of the workload"),
    "decode_floor_ms": ("ms", "roofline of one batch-1 decode step at the mean context"),
    "preemptions": ("", "sequences preempted during the run"),
}


class RecipeError(ValueError):
    """A recipe file is invalid (the message names the file and the field)."""


@dataclass
class Expectation:
    min: float | None = None
    max: float | None = None
    value: float | None = None
    rel_tol: float | None = None
    abs_tol: float | None = None

    def check(self, x: float | None) -> tuple[bool, str]:
        """(ok, why) for a measured value."""
        if x is None or x != x:
            return False, "not measured"
        if self.min is not None and x < self.min:
            return False, f"{x:.4g} < min {self.min:.4g}"
        if self.max is not None and x > self.max:
            return False, f"{x:.4g} > max {self.max:.4g}"
        if self.value is not None:
            tol = max((self.rel_tol or 0.0) * abs(self.value), self.abs_tol or 0.0)
            if abs(x - self.value) > tol:
                return False, f"{x:.4g} is not {self.value:.4g} ± {tol:.3g}"
        return True, "ok"

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class Hardware:
    device: str = "cpu"
    min_gpus: int = 0


@dataclass
class ModelSpec:
    path: str | None = None
    embedded: bool = False
    architecture: str | None = None
    load_dummy: str | None = None  # architecture: defaults to "xavier"

    @property
    def label(self) -> str:
        if self.embedded:
            return "embedded SmolLM2-135M-Instruct"
        if self.architecture:
            return f"{self.architecture} (dummy weights)"
        return str(self.path)

    @property
    def short_label(self) -> str:
        if self.embedded:
            return "SmolLM2-135M"
        if self.architecture:
            return f"{self.architecture} (dummy)"
        return os.path.basename(os.path.normpath(str(self.path)))


@dataclass
class Prompt:
    content: str
    system: str | None = None
    expect_contains: list[str] = field(default_factory=list)


@dataclass
class Workload:
    kind: str
    prompts: list[Prompt] = field(default_factory=list)          # chat
    num_prompts: int = 1                                          # random, nano-vllm, shared-prefix
    input_len: tuple[int, int] = (128, 128)                       # random
    output_len: tuple[int, int] = (128, 128)                      # random, nano-vllm (max)
    system_prompt: str | None = None                              # shared-prefix (text)
    system_prompt_len: int = 256                                  # shared-prefix (token ids)
    questions: list[str] = field(default_factory=list)            # shared-prefix (text)
    question_len: tuple[int, int] = (8, 32)                       # shared-prefix (token ids)
    prime_first: bool = True                                      # shared-prefix
    sampling: dict = field(default_factory=dict)
    seed: int = 0
    warmup: bool = True
    repeat: int = 1


@dataclass
class Recipe:
    name: str
    description: str
    hardware: Hardware
    model: ModelSpec
    workload: Workload
    metrics: list[str]
    expected: dict[str, Expectation] = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    status: str = "ready"
    pending_reason: str = ""
    roofline: dict = field(default_factory=dict)  # bandwidth (B/s), flops (FLOP/s)
    source: str = ""

    def sampling_params(self, **override) -> SamplingParams:
        return SamplingParams(**{**self.workload.sampling, **override})


# --- parsing -----------------------------------------------------------------------------
class _Ctx:
    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, value: Any, why: str) -> RecipeError:
        return RecipeError(f"{self.source}: {path}={value!r} is invalid: {why}")

    def mapping(self, path: str, value: Any, allowed: tuple[str, ...] | None) -> dict:
        if not isinstance(value, dict):
            raise self.fail(path, value, "must be a mapping")
        if allowed is not None:
            extra = [k for k in value if k not in allowed]
            if extra:
                raise RecipeError(f"{self.source}: {path}.{extra[0]} is not a known field: "
                                  f"{path} takes {', '.join(allowed)}")
        return value

    def str_(self, path: str, value: Any, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(path, value, "must be a non-empty string")
        if choices and value not in choices:
            raise self.fail(path, value, f"must be one of {', '.join(choices)}")
        return value

    def int_(self, path: str, value: Any, lo: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise self.fail(path, value, f"must be an integer >= {lo}")
        return value

    def num(self, path: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, value, "must be a number")
        return float(value)

    def bool_(self, path: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, value, "must be true or false")
        return value

    def range_(self, path: str, value: Any) -> tuple[int, int]:
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value, value]
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
                or value[0] > value[1]):
            raise self.fail(path, value, "must be an integer >= 1 or a range [lo, hi] with 1 <= lo <= hi")
        return int(value[0]), int(value[1])


TOP_FIELDS = ("name", "description", "status", "pending_reason", "hardware", "model", "engine",
              "workload", "metrics", "expected", "roofline")
WORKLOAD_FIELDS = ("kind", "prompts", "num_prompts", "input_len", "output_len", "system_prompt",
                   "system_prompt_len", "questions", "question_len", "prime_first", "sampling", "seed",
                   "warmup", "repeat")


def _engine_fields() -> tuple[str, ...]:
    from atom.config import Config
    skip = {"model", "hf_config", "generation_config"}
    return tuple(f.name for f in dataclasses.fields(Config) if f.init and f.name not in skip)


def parse_recipe(data: Any, source: str = "<recipe>") -> Recipe:
    """Validate a recipe mapping (what yaml.safe_load gives) and build the `Recipe`."""
    c = _Ctx(source)
    d = c.mapping("recipe", data, TOP_FIELDS)
    for req in ("name", "description", "hardware", "model", "workload", "metrics"):
        if req not in d:
            raise RecipeError(f"{source}: field '{req}' is missing")
    name = c.str_("name", d["name"])
    stem = os.path.splitext(os.path.basename(source))[0]
    if source.endswith((".yaml", ".yml")) and stem != name:
        raise c.fail("name", name, f"must match the file name ({stem!r})")
    status = c.str_("status", d.get("status", "ready"), STATUSES)
    pending_reason = d.get("pending_reason", "")
    if status == "pending":
        pending_reason = c.str_("pending_reason", pending_reason or "")

    h = c.mapping("hardware", d["hardware"], ("device", "min_gpus"))
    device = c.str_("hardware.device", h.get("device", "cpu"), DEVICES)
    min_gpus = c.int_("hardware.min_gpus", h.get("min_gpus", 0 if device == "cpu" else 1))
    if device != "cpu" and min_gpus < 1:
        raise c.fail("hardware.min_gpus", min_gpus, f"must be >= 1 for device {device}")

    m = c.mapping("model", d["model"], ("path", "embedded", "architecture", "load_dummy"))
    given = [k for k in ("path", "embedded", "architecture") if m.get(k) not in (None, False)]
    if len(given) != 1:
        raise c.fail("model", m, "give exactly one of path:, embedded: true, architecture:")
    model = ModelSpec(
        path=c.str_("model.path", m["path"]) if "path" in given else None,
        embedded=c.bool_("model.embedded", m["embedded"]) if "embedded" in given else False,
        architecture=c.str_("model.architecture", m["architecture"], tuple(MODEL_CONFIGS))
        if "architecture" in given else None,
        load_dummy=m.get("load_dummy") or ("xavier" if "architecture" in given else None))

    engine = dict(c.mapping("engine", d.get("engine") or {}, None))
    allowed = _engine_fields()
    for k in engine:
        if k not in allowed:
            raise RecipeError(f"{source}: engine.{k} is not an atom.Config field (see "
                              "spec/atom_configuration_guide.md)")

    workload = _parse_workload(c, d["workload"])

    metrics = d["metrics"]
    if not isinstance(metrics, list) or not metrics:
        raise c.fail("metrics", metrics, "must be a non-empty list of metric names")
    for i, x in enumerate(metrics):
        if x not in METRICS:
            raise c.fail(f"metrics[{i}]", x, f"must be one of {', '.join(METRICS)}")
    if "accuracy" in metrics and not any(p.expect_contains for p in workload.prompts):
        raise c.fail("metrics", "accuracy", "needs chat prompts with expect_contains")
    if "time_saved_vs_no_prefix_cache" in metrics and not engine.get("enable_prefix_caching"):
        raise c.fail("metrics", "time_saved_vs_no_prefix_cache", "needs engine.enable_prefix_caching: true")
    if {"roofline_fraction", "roofline_tok_s", "decode_floor_ms"} & set(metrics) and not model.architecture:
        raise c.fail("metrics", [x for x in metrics if "roofline" in x or "floor" in x],
                     "roofline metrics need model.architecture (a known model shape)")

    expected = {}
    for k, v in c.mapping("expected", d.get("expected") or {}, None).items():
        if k not in metrics:
            raise c.fail(f"expected.{k}", v, f"names no metric of this recipe (metrics: {', '.join(metrics)})")
        e = c.mapping(f"expected.{k}", v, ("min", "max", "value", "rel_tol", "abs_tol"))
        if not e:
            raise c.fail(f"expected.{k}", v, "give min, max, or value (with rel_tol / abs_tol)")
        exp = Expectation(**{f: c.num(f"expected.{k}.{f}", x) for f, x in e.items()})
        if (exp.rel_tol is not None or exp.abs_tol is not None) and exp.value is None:
            raise c.fail(f"expected.{k}", v, "rel_tol / abs_tol need a value")
        if exp.min is not None and exp.max is not None and exp.min > exp.max:
            raise c.fail(f"expected.{k}", v, "min must be <= max")
        expected[k] = exp

    roofline = c.mapping("roofline", d.get("roofline") or {}, ("bandwidth", "flops"))
    roofline = {k: c.num(f"roofline.{k}", v) for k, v in roofline.items()}
    return Recipe(name, c.str_("description", d["description"]), Hardware(device, min_gpus), model,
                  workload, list(metrics), expected, engine, status, pending_reason, roofline, source)


def _parse_workload(c: _Ctx, raw: Any) -> Workload:
    w = c.mapping("workload", raw, WORKLOAD_FIELDS)
    if "kind" not in w:
        raise RecipeError(f"{c.source}: field 'workload.kind' is missing")
    kind = c.str_("workload.kind", w["kind"], WORKLOAD_KINDS)
    out = Workload(kind)
    sampling = c.mapping("workload.sampling", w.get("sampling") or {}, None)
    try:
        SamplingParams(**sampling)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{c.source}: workload.sampling: {e}") from None
    out.sampling = dict(sampling)
    out.seed = c.int_("workload.seed", w.get("seed", 0))
    out.warmup = c.bool_("workload.warmup", w.get("warmup", True))
    out.repeat = c.int_("workload.repeat", w.get("repeat", 1), 1)
    if "num_prompts" in w:
        out.num_prompts = c.int_("workload.num_prompts", w["num_prompts"], 1)
    for key in ("input_len", "output_len", "question_len"):
        if key in w:
            setattr(out, key, c.range_(f"workload.{key}", w[key]))
    if kind == "chat":
        prompts = w.get("prompts")
        if not isinstance(prompts, list) or not prompts:
            raise c.fail("workload.prompts", prompts, "kind chat needs a non-empty list of prompts")
        for i, p in enumerate(prompts):
            path = f"workload.prompts[{i}]"
            if isinstance(p, str):
                p = {"content": p}
            p = c.mapping(path, p, ("content", "system", "expect_contains"))
            exp = p.get("expect_contains") or []
            exp = [exp] if isinstance(exp, str) else exp
            if not isinstance(exp, list) or not all(isinstance(x, str) and x for x in exp):
                raise c.fail(f"{path}.expect_contains", exp, "must be a string or a list of strings")
            out.prompts.append(Prompt(c.str_(f"{path}.content", p.get("content")),
                                      c.str_(f"{path}.system", p["system"]) if p.get("system") else None,
                                      exp))
    elif kind == "shared-prefix":
        if w.get("system_prompt") is not None:
            out.system_prompt = c.str_("workload.system_prompt", w["system_prompt"])
        out.system_prompt_len = c.int_("workload.system_prompt_len", w.get("system_prompt_len", 256), 1)
        qs = w.get("questions") or []
        if not isinstance(qs, list) or not all(isinstance(q, str) and q for q in qs):
            raise c.fail("workload.questions", qs, "must be a list of non-empty strings")
        if out.system_prompt and not qs:
            raise c.fail("workload.questions", qs, "a text system_prompt needs questions")
        out.questions = list(qs)
        out.prime_first = c.bool_("workload.prime_first", w.get("prime_first", True))
    elif kind == "nano-vllm":
        out.input_len = c.range_("workload.input_len", w.get("input_len", [100, 1024]))
        out.output_len = c.range_("workload.output_len", w.get("output_len", [100, 1024]))
        if out.input_len[0] != 100 or out.output_len[0] != 100:
            raise c.fail("workload.input_len", [out.input_len, out.output_len],
                         "nano-vllm lengths are uniform in [100, max]: give [100, max]")
    return out


def load_recipe(path: str) -> Recipe:
    """Read and validate one recipe file."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise RecipeError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({e})") from None
    return parse_recipe(data, path)
