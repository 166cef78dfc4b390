"""`QuantizationConfig`: the layer-wise quantization dispatcher (re-exported by `atom.config`)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from atom.quant_spec import (
    QUARK_LAYER_TYPES,
    ConfigGroup,
    GenericParser,
    GroupMatcher,
    LayerQuantConfig,
    QuantType,
    QuarkParser,
)

from atom.config_checks import _invalid
from atom.hf_config import _config_dtype

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# quantization
# ---------------------------------------------------------------------------


@dataclass
class _ParsedQuantConfig:
    """What `_parse` read: the global spec, the per-layer fnmatch patterns, the exclude list,
    Quark's per-module-type specs (``layer_type_quant_config``, by type name) and the
    compressed-tensors config groups with their matcher (empty / None for other formats)."""

    global_spec: LayerQuantConfig
    layer_pattern_specs: list[tuple[str, LayerQuantConfig]] = field(default_factory=list)
    exclude_layers: list[str] = field(default_factory=list)
    layer_type_specs: dict[str, LayerQuantConfig] = field(default_factory=dict)
    config_groups: list[ConfigGroup] = field(default_factory=list)
    group_matcher: Optional[GroupMatcher] = None


# shard name -> packed name, when no packed_modules_mapping is given.
_DEFAULT_PACKED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_DEEPSEEK_PACKED = {"q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj"}
# without q_lora_rank there is no q_a_proj: q_proj is the first part of the packed matrix
_DEEPSEEK_PACKED_NO_Q_LORA = {"q_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj"}


def _packed_to_shards(shard_to_packed: dict[str, str]) -> dict[str, list[str]]:
    """packed name -> its shard names, in the mapping's order."""
    out: dict[str, list[str]] = {}
    for shard, packed in shard_to_packed.items():
        out.setdefault(packed, []).append(shard)
    return out


class QuantizationConfig:
    """Layer-wise quantization, auto-detected from ``hf_config.quantization_config``.

    ``get_layer_quant_config(name)`` checks, in order: the exclude list (exact
    name, a parent module name, an fnmatch glob of the name or of a parent module, or
    ``"re:<regex>"`` matched from the start of the name), the per-layer fnmatch patterns,
    then the global spec. ``quant_method: "mxfp4"`` (transformers' GPT-OSS format) quantizes
    the MoE experts only (pattern ``*.experts``); ``modules_to_not_convert`` is excluded.

    Quark: Quark's precedence, ``layer_quant_config`` (patterns) > ``layer_type_quant_config``
    > ``global_quant_config``. Every layer here is a ``Linear`` (a MoE layer's experts too), so
    a ``"Linear"`` entry of ``layer_type_quant_config`` is the spec of every layer no pattern
    names; ``"Conv2d"`` / ``"ConvTranspose2d"`` entries name no layer here (logged); any other
    key is refused, as Quark refuses it.

    compressed-tensors: after the exclude list (``ignore``), each layer takes the spec of the
    config group whose ``targets`` match it, by compressed-tensors' rules
    (:class:`atom.quant_spec.GroupMatcher`: exact name > ``re:`` regex > class ``"Linear"``);
    a layer no group matches is not quantized. A packed layer (``qkv_proj``, ``gate_up_proj``:
    see :meth:`remap_layer_name`) is matched by its checkpoint shards' names (``q_proj`` ...),
    which must all resolve to one group (or to groups of identical specs), else the layer is
    refused: one packed weight holds one format. A MoE layer (``...mlp.experts``) is matched
    by that name, as one ``Linear``: a target aimed at single experts' projections
    (``re:.*experts\\.0\\..*``, ``re:.*down_proj$``) does not see it. ``global_quant_config`` is
    the spec of the group that targets ``Linear`` (unquantized when none does).
    """

    def __init__(self, hf_config: Optional[Any] = None):
        self.torch_dtype: torch.dtype = (
            _config_dtype(hf_config) if hf_config is not None else None
        ) or torch.bfloat16
        raw = getattr(hf_config, "quantization_config", None) if hf_config is not None else None
        if raw is None and hf_config is not None:
            text = getattr(hf_config, "text_config", None)
            raw = getattr(text, "quantization_config", None) if text is not None else None
        if raw is not None and not isinstance(raw, dict):
            raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw)
        self.hf_quant_config: Optional[dict] = raw or None
        self.quant_method: str = str((raw or {}).get("quant_method", "") or "")
        self._parsed = self._parse(self.hf_quant_config)
        self._compile_excludes()
        # packed layer name -> checkpoint shard names (remap_layer_name sets the model's own)
        self._packed_shards = _packed_to_shards(_DEFAULT_PACKED)
        self._matcher = self._parsed.group_matcher

    # -- parsing ----------------------------------------------------------

    def _unquantized(self) -> LayerQuantConfig:
        return LayerQuantConfig(QuantType.No, self.torch_dtype, True, "")

    def _parse(self, cfg: Optional[dict]) -> _ParsedQuantConfig:
        if not cfg:
            return _ParsedQuantConfig(self._unquantized())
        if self.quant_method.lower() == "quark":
            parser = QuarkParser(self.torch_dtype)
            layers = cfg.get("layer_quant_config") or {}
            exclude = cfg.get("exclude") or []
            return _ParsedQuantConfig(
                parser.parse(cfg.get("global_quant_config")),
                [(pattern, parser.parse(spec)) for pattern, spec in layers.items()],
                [exclude] if isinstance(exclude, str) else list(exclude),
                self._quark_layer_types(parser, cfg.get("layer_type_quant_config")),
            )
        exclude = GenericParser.exclude_layers(cfg)
        for name in cfg.get("modules_to_not_convert") or []:
            if name not in exclude:
                exclude.append(name)
        if self.quant_method.lower() == "mxfp4":
            # transformers' / OpenAI's MXFP4 (GPT-OSS): only the MoE experts are stored in MXFP4,
            # every other layer stays in the model's dtype
            return _ParsedQuantConfig(self._unquantized(), [("*.experts", GenericParser().parse(cfg))], exclude)
        if self.quant_method.lower() == "compressed-tensors":
            groups = GenericParser().parse_groups(cfg)
            if groups:
                # each group applies to the layers its targets match (get_layer_quant_config); the
                # global spec is what a layer named by no name / regex target gets
                matcher = GroupMatcher(groups)
                default = matcher.class_match()
                spec = default[1].spec if default is not None else None
                return _ParsedQuantConfig(spec if spec is not None else self._unquantized(), [], exclude,
                                          config_groups=groups, group_matcher=matcher)
        return _ParsedQuantConfig(GenericParser().parse(cfg), [], exclude)

    @staticmethod
    def _quark_layer_types(parser: QuarkParser, raw: Any) -> dict[str, LayerQuantConfig]:
        """Quark's ``layer_type_quant_config`` (module type name -> layer config) as specs.

        Every layer here is a ``Linear``, so only that entry applies (between the per-layer
        patterns and the global spec); ``Conv2d`` / ``ConvTranspose2d`` entries are read (so a
        bad one still fails) but name no layer here; other keys are refused, as Quark does."""
        if raw is None or raw == {}:
            return {}
        if not isinstance(raw, dict):
            raise _invalid("layer_type_quant_config", raw, "must be a dict of module type name -> layer config")
        out: dict[str, LayerQuantConfig] = {}
        for type_name, spec in raw.items():
            if type_name not in QUARK_LAYER_TYPES:
                raise _invalid("layer_type_quant_config", {type_name: spec},
                               f"keys must be one of Quark's layer types {list(QUARK_LAYER_TYPES)}")
            if not isinstance(spec, dict):
                raise _invalid(f"layer_type_quant_config.{type_name}", spec,
                               "must be a layer config dict (weight, input_tensors, ...)")
            out[type_name] = parser.parse(spec)
        unused = [name for name in out if name != "Linear"]
        if unused:
            logger.info("quark layer_type_quant_config entries %s name no layer here: every quantized layer "
                        "is a Linear", unused)
        return out

    def _compile_excludes(self):
        self._exclude_regexes = []
        for entry in self._parsed.exclude_layers:
            if not isinstance(entry, str) or not entry:
                raise _invalid("exclude_layers", entry, "entries must be non-empty strings")
            if entry.startswith("re:"):
                try:
                    self._exclude_regexes.append(re.compile(entry[3:]))
                except re.error as exc:
                    raise _invalid("exclude_layers", entry, f"bad regex ({exc})") from None

    # -- public attributes --------------------------------------------------

    @property
    def global_quant_config(self) -> LayerQuantConfig:
        return self._parsed.global_spec

    @property
    def exclude_layers(self) -> list[str]:
        return self._parsed.exclude_layers

    @property
    def layer_pattern_specs(self) -> list[tuple[str, LayerQuantConfig]]:
        return self._parsed.layer_pattern_specs

    def get_name(self) -> str:
        """The quantization method name (``""`` for an unquantized model)."""
        return self.quant_method

    # -- dispatch -------------------------------------------------------------

    def is_excluded(self, layer_name: str) -> bool:
        if any(rx.match(layer_name) for rx in self._exclude_regexes):
            return True
        for entry in self._parsed.exclude_layers:
            if entry.startswith("re:"):
                continue
            if any(c in entry for c in "*?["):
                # the glob names the layer or a module above it ("model.layers.*.self_attn")
                if fnmatch.fnmatchcase(layer_name, entry) or fnmatch.fnmatchcase(layer_name, entry + ".*"):
                    return True
            elif layer_name == entry or layer_name.startswith(entry + "."):
                return True
        return False

    def get_layer_quant_config(self, layer_name: str) -> LayerQuantConfig:
        """Spec for ``layer_name``: exclusions, then per-layer patterns, then (compressed-tensors)
        the config group whose targets match it or (Quark) the ``Linear`` entry of
        ``layer_type_quant_config``, then global. Raises ValueError for a packed layer whose
        shards resolve to different groups, and for a layer matched by a group that quantizes
        no weights."""
        if self.is_excluded(layer_name):
            return self._unquantized()
        for pattern, spec in self._parsed.layer_pattern_specs:
            if fnmatch.fnmatchcase(layer_name, pattern):
                return spec
        if self._matcher is not None:
            return self._group_spec(layer_name)
        linear = self._parsed.layer_type_specs.get("Linear")
        if linear is not None:
            return linear
        return self._parsed.global_spec

    def _group_spec(self, layer_name: str) -> LayerQuantConfig:
        """Spec of the compressed-tensors config group that quantizes ``layer_name``."""
        found = self._group_of(layer_name)
        if found is None:
            return self._unquantized()  # as compressed-tensors leaves a module no target matches
        target, group = found
        if group.spec is None:
            raise ValueError(
                f"layer {layer_name!r} is matched by compressed-tensors config group {group.name!r} "
                f"(target {target!r}), which cannot be loaded: {group.problem}"
            )
        return group.spec

    def _group_of(self, layer_name: str) -> Optional[tuple[str, ConfigGroup]]:
        """(target, group) for ``layer_name``; a packed layer is matched by its shards' names."""
        assert self._matcher is not None
        parent, _, last = layer_name.rpartition(".")
        shards = self._packed_shards.get(last)
        if not shards:
            return self._matcher.match(layer_name)
        names = [f"{parent}.{shard}" if parent else shard for shard in shards]
        found = [self._matcher.match(name) for name in names]

        def describe(hit: Optional[tuple[str, ConfigGroup]]) -> str:
            return "no group (unquantized)" if hit is None else f"group {hit[1].name!r} (target {hit[0]!r})"

        def same(a: Optional[tuple[str, ConfigGroup]], b: Optional[tuple[str, ConfigGroup]]) -> bool:
            if a is None or b is None:
                return a is b
            if a[1] is b[1]:
                return True
            return a[1].spec is not None and b[1].spec is not None and a[1].spec.to_dict() == b[1].spec.to_dict()

        for name, hit in zip(names[1:], found[1:]):
            if not same(found[0], hit):
                raise ValueError(
                    f"layer {layer_name!r} packs the checkpoint shards {names}, which compressed-tensors "
                    f"quantizes differently: {names[0]!r} by {describe(found[0])}, {name!r} by "
                    f"{describe(hit)}; one packed weight holds one format, so all its shards must "
                    "resolve to the same config group (or to groups with identical schemes)"
                )
        return found[0]

    def remap_layer_name(
        self, hf_config: Any = None, packed_modules_mapping: Optional[dict] = None
    ) -> "QuantizationConfig":
        """Add packed/fused names to the exclude list and per-layer patterns.

        A checkpoint names shards (``q_proj``); ATOM's layers are packed
        (``qkv_proj``). ``packed_modules_mapping`` may map shard -> ``(packed,
        shard_id)`` (nano-vllm style), shard -> ``packed``, or packed -> list of
        shards (vLLM style). Without it, q/k/v -> ``qkv_proj`` and gate/up ->
        ``gate_up_proj``; DeepSeek-style configs map ``q_a_proj`` (with a ``q_lora_rank``,
        else ``q_proj``) / ``kv_a_proj_with_mqa`` -> ``fused_qkv_a_proj``.
        Original names are kept. Returns ``self``.
        """
        shard_to_packed = self._shard_map(hf_config, packed_modules_mapping)
        # compressed-tensors groups match a packed layer by its shards' names (get_layer_quant_config)
        self._packed_shards = _packed_to_shards(shard_to_packed)
        if not shard_to_packed:
            return self

        def rename(name: str) -> str:
            for shard, packed in shard_to_packed.items():
                name = re.sub(rf"(?<![A-Za-z0-9_]){re.escape(shard)}(?![A-Za-z0-9_])", packed, name)
            return name

        excludes: list[str] = []
        for entry in self._parsed.exclude_layers:
            for name in (entry, rename(entry)):
                if name not in excludes:
                    excludes.append(name)
        patterns: list[tuple[str, LayerQuantConfig]] = []
        seen: set[str] = set()
        for pattern, spec in self._parsed.layer_pattern_specs:
            for name in (pattern, rename(pattern)):
                if name not in seen:
                    seen.add(name)
                    patterns.append((name, spec))
        self._parsed.exclude_layers = excludes
        self._parsed.layer_pattern_specs = patterns
        self._compile_excludes()
        return self

    @staticmethod
    def _shard_map(hf_config: Any, mapping: Optional[dict]) -> dict[str, str]:
        if mapping is None:
            out = dict(_DEFAULT_PACKED)
            model_type = str(getattr(hf_config, "model_type", "") or "")
            if "deepseek" in model_type or model_type in ("kimi_k2", "glm_moe_dsa"):
                no_q_lora = getattr(hf_config, "q_lora_rank", None) is None
                out.update(_DEEPSEEK_PACKED_NO_Q_LORA if no_q_lora else _DEEPSEEK_PACKED)
            return out
        out = {}
        for key, value in mapping.items():
            if isinstance(value, str):
                out[key] = value
            elif isinstance(value, tuple) and value and isinstance(value[0], str):
                out[key] = value[0]
            elif isinstance(value, list):
                for shard in value:
                    out[str(shard)] = key
            else:
                raise _invalid(
                    "packed_modules_mapping",
                    {key: value},
                    "values must be (packed_name, shard_id), a packed name, "
                    "or a list of shard names",
                )
        return out

    def compute_hash(self) -> str:
        """SHA-256 over the parsed config, for compilation-cache invalidation."""
        payload = {
            "quant_method": self.quant_method,
            "torch_dtype": str(self.torch_dtype),
            "global": self._parsed.global_spec.to_dict(),
            "layers": [[p, s.to_dict()] for p, s in self._parsed.layer_pattern_specs],
            "exclude": list(self._parsed.exclude_layers),
        }
        # only when present, so that the hashes of other configs stay as they were
        if self._parsed.layer_type_specs:
            payload["layer_types"] = {k: s.to_dict() for k, s in self._parsed.layer_type_specs.items()}
        if self._parsed.config_groups:
            payload["config_groups"] = [
                [g.name, list(g.targets), g.spec.to_dict() if g.spec is not None else g.problem]
                for g in self._parsed.config_groups
            ]
            payload["packed"] = self._packed_shards
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def __repr__(self) -> str:
        g = self._parsed.global_spec
        return (
            f"QuantizationConfig(method={self.quant_method!r}, "
            f"global={g.quant_type.name}/{str(g.quant_dtype).replace('torch.', '')}"
            f"{'/dynamic' if g.is_dynamic else '/static'}, "
            f"layer_overrides={len(self._parsed.layer_pattern_specs)}, "
            + (f"config_groups={[g.name for g in self._parsed.config_groups]!r}, "
               if self._parsed.config_groups else "")
            + f"exclude={self._parsed.exclude_layers!r})"
        )


