"""Per-layer quantization specs and the parsers that read them from checkpoints.

A :class:`LayerQuantConfig` says how one linear layer (or the model as a whole)
is quantized: the granularity of its scales (:class:`QuantType`), the storage
dtype of its weights, whether activation scales are computed at run time, and
the method name the checkpoint declared.

Two parsers turn the ``quantization_config`` dict of a HuggingFace config into
specs:

* :class:`QuarkParser` for AMD Quark checkpoints (``quant_method == "quark"``),
* :class:`GenericParser` for everything else (FP8 block checkpoints,
  compressed-tensors, GPTQ/AWQ-style ``bits`` + ``group_size``).

A compressed-tensors config may hold several ``config_groups``, each quantizing the
modules its ``targets`` name: :meth:`GenericParser.parse_groups` reads one
:class:`ConfigGroup` per group and :class:`GroupMatcher` says which group a module
belongs to, by compressed-tensors' own matching rules.

Dtype keys follow AITER's names (``fp8``, ``fp4x2``, ``i8``, ``i4x2``). Their
torch dtypes here:

* ``fp8``   -> ``torch.float8_e4m3fn`` (OCP E4M3, the format checkpoints store;
  a ROCm kernel backend may map it to ``float8_e4m3fnuz`` itself).
* ``fp4x2`` -> ``torch.float4_e2m1fn_x2`` (two E2M1 values per byte) where this
  torch has it, otherwise ``torch.uint8`` as the packed container.
* ``i8``    -> ``torch.int8``.
* ``i4x2``  -> ``torch.uint8``: two 4-bit integers packed per byte. An unsigned
  container is chosen so that ``i4x2`` never collides with ``i8``
  (``torch.int8``); the sign of each nibble is the kernel's business.
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "QuantType",
    "LayerQuantConfig",
    "ACT_SCHEMES",
    "DTYPE_KEYS",
    "dtype_from_key",
    "key_from_dtype",
    "QuarkParser",
    "QUARK_LAYER_TYPES",
    "GenericParser",
    "ConfigGroup",
    "GroupMatcher",
    "LINEAR_CLASS_TARGETS",
    "ONLINE_QUANT_FORMATS",
    "online_quant_spec",
]


class QuantType(enum.Enum):
    """Granularity of quantization scales (names follow AITER)."""

    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4
    per_128x128 = 5


_FP4X2 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)

#: AITER dtype key -> torch dtype of the stored (possibly packed) weight.
DTYPE_KEYS: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp4x2": _FP4X2,
    "i8": torch.int8,
    "i4x2": torch.uint8,
}


def dtype_from_key(key: str) -> torch.dtype:
    """Torch dtype for an AITER dtype key (``"fp8"``, ``"fp4x2"``, ``"i8"``, ``"i4x2"``)."""
    try:
        return DTYPE_KEYS[key]
    except KeyError:
        raise ValueError(
            f"quant dtype key {key!r} is invalid: must be one of {sorted(DTYPE_KEYS)}"
        ) from None


def key_from_dtype(dtype: torch.dtype) -> Optional[str]:
    """Inverse of :func:`dtype_from_key`; ``None`` for an unquantized dtype."""
    for key, value in DTYPE_KEYS.items():
        if value == dtype:
            return key
    return None


#: Values of :attr:`LayerQuantConfig.act_scheme`: how activations are quantized.
ACT_SCHEMES = ("none", "tensor", "token", "group")


@dataclass(frozen=True)
class LayerQuantConfig:
    """How one layer (or the whole model, as the global default) is quantized.

    The four leading fields are the spec's identity. The details after them say what a
    linear method needs beyond the granularity (``None``: the method's default for the
    quant type): ``group_size`` (weight scales per group of input columns),
    ``block_size`` ((rows, cols) of a weight block), ``symmetric`` (False: zero points),
    ``act_scheme`` (one of :data:`ACT_SCHEMES`: activations not quantized, one scale per
    tensor, per token, or per group of ``act_group_size`` columns), ``act_dtype`` (the
    activations' dtype key, e.g. ``"fp4x2"`` for MXFP4 activations). The details take no
    part in ``==`` (specs built from the four fields compare as before); ``to_dict`` and
    so ``QuantizationConfig.compute_hash`` include those that are set.
    """

    quant_type: QuantType = QuantType.No
    quant_dtype: torch.dtype = torch.bfloat16
    is_dynamic: bool = True
    quant_method: str = ""
    group_size: Optional[int] = field(default=None, compare=False)
    block_size: Optional[tuple[int, int]] = field(default=None, compare=False)
    symmetric: Optional[bool] = field(default=None, compare=False)
    act_scheme: Optional[str] = field(default=None, compare=False)
    act_group_size: Optional[int] = field(default=None, compare=False)
    act_dtype: Optional[str] = field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.quant_type, QuantType):
            raise ValueError(
                f"quant_type={self.quant_type!r} is invalid: must be a QuantType"
            )
        if not isinstance(self.quant_dtype, torch.dtype):
            raise ValueError(
                f"quant_dtype={self.quant_dtype!r} is invalid: must be a torch.dtype"
            )
        for name in ("group_size", "act_group_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}={value!r} is invalid: must be a positive int or None")
        if self.block_size is not None:
            block = tuple(self.block_size)
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ValueError(
                    f"block_size={self.block_size!r} is invalid: must be (rows, cols) of positive ints"
                )
            object.__setattr__(self, "block_size", block)
        if self.act_dtype is not None and self.act_dtype not in DTYPE_KEYS:
            raise ValueError(
                f"act_dtype={self.act_dtype!r} is invalid: must be one of {sorted(DTYPE_KEYS)} or None"
            )
        if self.act_scheme is not None and self.act_scheme not in ACT_SCHEMES:
            raise ValueError(
                f"act_scheme={self.act_scheme!r} is invalid: must be one of {ACT_SCHEMES} or None"
            )
        # MXFP4 always carries one E8M0 scale per 32 values. (Only checkable
        # here when torch has a distinct fp4 dtype; the parsers force it too.)
        if _FP4X2 is not torch.uint8 and self.quant_dtype == _FP4X2:
            if self.quant_type is not QuantType.per_1x32:
                object.__setattr__(self, "quant_type", QuantType.per_1x32)

    @property
    def is_quantized(self) -> bool:
        return self.quant_type is not QuantType.No

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (used for hashing and display)."""
        out = {
            "quant_type": self.quant_type.name,
            "quant_dtype": str(self.quant_dtype).replace("torch.", ""),
            "is_dynamic": self.is_dynamic,
            "quant_method": self.quant_method,
        }
        for name in ("group_size", "block_size", "symmetric", "act_scheme", "act_group_size", "act_dtype"):
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value) if isinstance(value, tuple) else value
        return out


# ---------------------------------------------------------------------------
# dtype string recognition
# ---------------------------------------------------------------------------


def _spec(
    quant_type: QuantType, key: str, is_dynamic: bool, method: str, **details: Any
) -> LayerQuantConfig:
    """Build a spec from a dtype key; MXFP4 (``fp4x2``) forces ``per_1x32``."""
    if key == "fp4x2":
        quant_type = QuantType.per_1x32
    return LayerQuantConfig(quant_type, DTYPE_KEYS[key], is_dynamic, method, **details)


def _pos_int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _dtype_key_from_string(text: str) -> Optional[str]:
    """Recognise a dtype key in a free-form string such as ``"fp8_e4m3"``."""
    s = text.lower()
    if "fp4" in s or "mxfp4" in s or "e2m1" in s:
        return "fp4x2"
    if "fp8" in s or "e4m3" in s or "float8" in s:
        return "fp8"
    if "int4" in s or "uint4" in s:
        return "i4x2"
    if "int8" in s:
        return "i8"
    return None


def _dtype_key_from_bits(bits: Any, kind: Any) -> Optional[str]:
    """``num_bits`` (+ ``type`` = ``"int"``/``"float"``) -> dtype key."""
    try:
        bits = int(bits)
    except (TypeError, ValueError):
        return None
    is_float = str(kind).lower() == "float"
    if bits == 8:
        return "fp8" if is_float else "i8"
    if bits == 4:
        return "fp4x2" if is_float else "i4x2"
    return None


# ---------------------------------------------------------------------------
# Quark
# ---------------------------------------------------------------------------

_QUARK_QSCHEME = {
    "per_channel": QuantType.per_Token,
    "per_tensor": QuantType.per_Tensor,
    "per_group": QuantType.per_1x32,
}


#: The module types Quark's ``layer_type_quant_config`` is keyed by (Quark's own
#: ``QUARK_LAYER_TYPES``; it refuses any other key when it reloads a config).
QUARK_LAYER_TYPES = ("Linear", "Conv2d", "ConvTranspose2d")


class QuarkParser:
    """Parses AMD Quark config dicts (``global_quant_config`` and each
    ``layer_quant_config`` entry) into :class:`LayerQuantConfig`.

    ``weight.qscheme`` sets the quant type (``per_channel`` -> ``per_Token``,
    ``per_tensor`` -> ``per_Tensor``, ``per_group`` -> ``per_1x32``),
    ``weight.dtype`` the quant dtype (``uint4``: ``torch.uint4``, which no linear method
    runs, so such layers are refused at build rather than read as signed int4), and ``input_tensors.is_dynamic`` the
    dynamic flag (``True`` when absent).
    """

    method = "quark"

    def __init__(self, default_dtype: torch.dtype = torch.bfloat16):
        self.default_dtype = default_dtype

    @staticmethod
    def _first(entry: Any) -> Optional[dict]:
        # Quark allows a list of specs for one tensor (e.g. two-level scales).
        if isinstance(entry, (list, tuple)):
            entry = entry[0] if entry else None
        return entry if isinstance(entry, dict) else None

    def parse(self, cfg: Optional[dict]) -> LayerQuantConfig:
        cfg = cfg or {}
        weight = self._first(cfg.get("weight"))
        inputs = self._first(cfg.get("input_tensors"))
        is_dynamic = True
        if inputs is not None and inputs.get("is_dynamic") is not None:
            is_dynamic = bool(inputs["is_dynamic"])
        if weight is None:
            return LayerQuantConfig(
                QuantType.No, self.default_dtype, is_dynamic, self.method
            )
        qscheme = str(weight.get("qscheme", "per_tensor")).lower()
        if qscheme not in _QUARK_QSCHEME:
            raise ValueError(
                f"quark weight.qscheme={qscheme!r} is invalid: must be one of "
                f"{sorted(_QUARK_QSCHEME)}"
            )
        dtype_name = str(weight.get("dtype", ""))
        key = _dtype_key_from_string(dtype_name)
        if key is None:
            raise ValueError(
                f"quark weight.dtype={dtype_name!r} is invalid: must name fp8, fp4, "
                "int8 or int4"
            )
        if "uint4" in dtype_name.lower():
            # unsigned nibbles with zero points: no method reads them, and reading them as
            # the signed int4 layout would be silently wrong; the layer build refuses it
            return LayerQuantConfig(_QUARK_QSCHEME[qscheme], torch.uint4, is_dynamic, self.method,
                                    group_size=_pos_int(weight.get("group_size")), symmetric=False)
        details: dict[str, Any] = {}
        if qscheme == "per_group":
            details["group_size"] = _pos_int(weight.get("group_size"))
        if weight.get("symmetric") is not None:
            details["symmetric"] = bool(weight["symmetric"])
        if inputs is None:
            details["act_scheme"] = "none"
        else:
            in_scheme = str(inputs.get("qscheme", "per_tensor")).lower()
            details["act_scheme"] = {"per_tensor": "tensor", "per_channel": "token",
                                     "per_group": "group"}.get(in_scheme)
            if in_scheme == "per_group":
                details["act_group_size"] = _pos_int(inputs.get("group_size"))
            details["act_dtype"] = _dtype_key_from_string(str(inputs.get("dtype", "")))
        return _spec(_QUARK_QSCHEME[qscheme], key, is_dynamic, self.method, **details)


# ---------------------------------------------------------------------------
# Everything else
# ---------------------------------------------------------------------------


def _walk(obj: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair of a nested dict/list structure, depth first."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield str(key), value
            yield from _walk(value)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _walk(item)


#: The class names a layer here answers to as a compressed-tensors target. Each linear layer
#: (and each expert of a MoE layer) is a ``torch.nn.Linear`` in the model the checkpoint was
#: made from, and compressed-tensors matches a class target against every class of the
#: module's MRO: ``Linear``, then ``Module``.
LINEAR_CLASS_TARGETS = ("Linear", "Module")


@dataclass(frozen=True)
class ConfigGroup:
    """One compressed-tensors config group: its name, its ``targets`` and the spec of the
    modules they match. ``spec`` is None for a group that quantizes no weights; ``problem``
    then says why no linear layer can take it (raised for the layers the group matches only,
    so that a group aimed at other modules, e.g. attention-only activation schemes, does not
    refuse the checkpoint)."""

    name: str
    targets: tuple[str, ...]
    spec: Optional[LayerQuantConfig]
    problem: Optional[str] = None


def _config_groups(cfg: dict) -> dict[str, dict]:
    """The dict-valued entries of ``cfg["config_groups"]`` (``{}`` when there are none)."""
    groups = cfg.get("config_groups") or {}
    if not isinstance(groups, dict):
        return {}
    return {str(name): group for name, group in groups.items() if isinstance(group, dict)}


class GenericParser:
    """Parses non-Quark ``quantization_config`` dicts (FP8 block checkpoints,
    compressed-tensors, ``bits``/``group_size`` formats).

    Rules, in order:

    1. quant type: ``per_Token`` for compressed-tensors or when channel
       quantization is declared; a ``weight_block_size`` / ``group_size`` of 128
       gives ``per_1x128`` and of 32 ``per_1x32``; otherwise ``per_Tensor``.
    2. dtype: from ``dtype`` / ``weight_dtype`` / ``fmt`` / ``quant_method``
       strings (fp8, fp4, mxfp4, int8, int4), else from ``num_bits``/``bits``.
    3. ``activation_scheme == "static"`` (or ``input_activations.dynamic ==
       False``) makes ``is_dynamic`` False.
    4. excluded layers come from ``ignore`` (see :meth:`exclude_layers`).

    :meth:`parse` reads one spec, so it refuses a compressed-tensors config of several
    config groups (one spec for all of them would give every layer one group's format);
    :meth:`parse_groups` reads each group with its targets.
    """

    _DTYPE_FIELDS = ("dtype", "weight_dtype", "fmt", "quant_method")

    def parse(self, cfg: dict) -> LayerQuantConfig:
        method = str(cfg.get("quant_method", "") or "")
        if method == "compressed-tensors" and len(_config_groups(cfg)) > 1:
            raise ValueError(
                f"quantization_config.config_groups={sorted(_config_groups(cfg))!r} is invalid here: "
                "GenericParser.parse reads one spec, which would give every layer one group's format; "
                "read several groups with GenericParser.parse_groups, each applying to the modules its "
                "targets match"
            )
        pairs = list(_walk(cfg))

        quant_type = QuantType.per_Tensor
        channel = any(
            (k == "strategy" and str(v).lower() == "channel")
            or (isinstance(v, str) and v.lower() == "per_channel")
            for k, v in pairs
        )
        if method == "compressed-tensors" or channel:
            quant_type = QuantType.per_Token
        group = self._group_size(pairs)
        if group == 128:
            quant_type = QuantType.per_1x128
        elif group == 32:
            quant_type = QuantType.per_1x32

        # compressed-tensors: the weights' own num_bits / type (an activation scheme of another
        # width or type, W4A8 say, must not decide the weight format)
        groups = list(_config_groups(cfg).values()) if method == "compressed-tensors" else []
        weights = groups[0].get("weights") if len(groups) == 1 else None
        key = self._dtype_key(list(_walk(weights))) if isinstance(weights, dict) else None
        key = key or self._dtype_key(pairs)
        if key is None:
            raise ValueError(
                f"quantization_config={cfg!r} is invalid: cannot tell the weight dtype; "
                "expected one of the fields dtype/weight_dtype/fmt/quant_method naming "
                "fp8, fp4, mxfp4, int8 or int4, or num_bits/bits of 8 or 4"
            )

        is_dynamic = True
        if str(cfg.get("activation_scheme", "")).lower() == "static":
            is_dynamic = False
        for k, v in pairs:
            if k == "input_activations" and isinstance(v, dict):
                if v.get("dynamic") is False:
                    is_dynamic = False
        details: dict[str, Any] = {}
        if method == "compressed-tensors":
            quant_type = self._compressed_tensors_details(cfg, quant_type, details)
        elif isinstance(cfg.get("weight_block_size"), (list, tuple)):
            block = [_pos_int(b) for b in cfg["weight_block_size"]]
            if len(block) == 2 and all(block):
                # DeepSeek / HF fine-grained fp8: 1 x block[1] dynamic activation groups
                details.update(block_size=tuple(block), act_scheme="group", act_group_size=block[1])
        elif key == "fp8" and quant_type is QuantType.per_Tensor:
            details["act_scheme"] = "tensor"  # HF/vLLM "fp8": input_scale when static
        elif _pos_int(cfg.get("group_size")) and key == "i4x2":
            details.update(group_size=cfg["group_size"], act_scheme="none")
        return _spec(quant_type, key, is_dynamic, method, **details)

    def parse_groups(self, cfg: dict) -> list[ConfigGroup]:
        """One :class:`ConfigGroup` per entry of a compressed-tensors ``config_groups``, in the
        config's order (``[]`` when it has none).

        Each group's spec is :meth:`parse` of the config with that group alone, so a one-group
        config gives the spec it always did and no group's fields leak into another's. A group
        without ``weights`` (activations only) gets no spec but a ``problem``; ``targets`` must
        be a non-empty list of strings (compressed-tensors requires them too).
        """
        raw = cfg.get("config_groups")
        if raw is None or raw == {}:
            return []
        if not isinstance(raw, dict):
            raise ValueError(
                f"config_groups={raw!r} is invalid: must be a dict of group name -> "
                "{targets, weights, input_activations}"
            )
        out: list[ConfigGroup] = []
        for name, group in raw.items():
            where = f"config_groups.{name}"
            if not isinstance(group, dict):
                raise ValueError(
                    f"{where}={group!r} is invalid: must be a dict with targets, weights and "
                    "input_activations"
                )
            targets = group.get("targets")
            targets = [targets] if isinstance(targets, str) else targets
            if (
                not isinstance(targets, (list, tuple))
                or not targets
                or not all(isinstance(t, str) and t for t in targets)
            ):
                raise ValueError(
                    f"{where}.targets={group.get('targets')!r} is invalid: must be a non-empty list "
                    "of module class names (\"Linear\"), \"re:<regex>\" patterns or module names"
                )
            if not isinstance(group.get("weights"), dict):
                out.append(ConfigGroup(
                    str(name), tuple(targets), None,
                    f"{where}.weights={group.get('weights')!r}: the group quantizes no weights "
                    "(activations only), which no linear method here runs",
                ))
                continue
            try:
                spec = self.parse({**cfg, "config_groups": {name: group}})
            except ValueError as exc:
                raise ValueError(f"{where} (targets {list(targets)}) cannot be read: {exc}") from None
            out.append(ConfigGroup(str(name), tuple(targets), spec))
        return out

    @staticmethod
    def _compressed_tensors_details(cfg: dict, quant_type: QuantType, details: dict) -> QuantType:
        """Fill `details` from the config group of a one-group compressed-tensors config (several
        groups are read one by one, :meth:`parse_groups`); the weight strategy "tensor" makes the
        quant type per_Tensor."""
        groups = list(_config_groups(cfg).values())
        if not groups:
            return quant_type
        group = groups[0]
        weights = group.get("weights") if isinstance(group.get("weights"), dict) else {}
        inputs = group.get("input_activations")
        strategy = str(weights.get("strategy") or "").lower()
        if strategy == "tensor":
            quant_type = QuantType.per_Tensor
        if strategy == "group":
            details["group_size"] = _pos_int(weights.get("group_size"))
        if strategy == "block":
            block = weights.get("block_structure")
            if isinstance(block, (list, tuple)) and len(block) == 2 and all(_pos_int(b) for b in block):
                details["block_size"] = tuple(block)
        if weights.get("symmetric") is not None:
            details["symmetric"] = bool(weights["symmetric"])
        if not isinstance(inputs, dict):
            details["act_scheme"] = "none"
        else:
            in_strategy = str(inputs.get("strategy") or "").lower()
            if in_strategy in ("tensor", "token", "group"):
                details["act_scheme"] = in_strategy
            if in_strategy == "group":
                details["act_group_size"] = _pos_int(inputs.get("group_size"))
            details["act_dtype"] = _dtype_key_from_bits(inputs.get("num_bits"), inputs.get("type", "int"))
        return quant_type

    @staticmethod
    def _group_size(pairs: list[tuple[str, Any]]) -> Optional[int]:
        for k, v in pairs:
            if k == "weight_block_size" and isinstance(v, (list, tuple)) and v:
                return int(v[-1])
            if k == "group_size" and isinstance(v, int) and v > 0:
                return v
        return None

    def _dtype_key(self, pairs: list[tuple[str, Any]]) -> Optional[str]:
        for field_name in self._DTYPE_FIELDS:
            for k, v in pairs:
                if k == field_name and isinstance(v, str):
                    key = _dtype_key_from_string(v)
                    if key is not None:
                        return key
        for k, v in pairs:
            if k in ("num_bits", "bits"):
                kind = next((val for key, val in pairs if key == "type"), "int")
                key = _dtype_key_from_bits(v, kind)
                if key is not None:
                    return key
        return None

    @staticmethod
    def exclude_layers(cfg: dict) -> list[str]:
        ignore = cfg.get("ignore") or []
        return [ignore] if isinstance(ignore, str) else list(ignore)


class GroupMatcher:
    """Which compressed-tensors config group quantizes a module, by compressed-tensors' rules
    (``apply_quantization_config`` with ``utils.match.match_targets``, compressed-tensors 0.19):

    * every target of every group names its group; a target two groups list belongs to the
      later one (compressed-tensors keys one dict by target);
    * a target ``"re:<regex>"`` matches a module whose full name ``re.match``-es the regex
      (anchored at the start of the name, not at its end: ``re:.*mlp.*`` matches
      ``model.layers.0.mlp.down_proj``); a class name in :data:`LINEAR_CLASS_TARGETS`
      matches every layer; any other target matches the module of exactly that name;
    * of the targets a module matches, exact names win over regexes, which win over class
      names; within a kind the target that sorts first wins (compressed-tensors sorts the
      targets). So ``re:.*self_attn.*`` overrides ``"Linear"`` for the attention layers.
    * a module no target matches is not quantized (``match`` gives None).

    ``ignore`` is not applied here: the dispatcher checks it first.
    """

    def __init__(self, groups: list[ConfigGroup]):
        self.groups = list(groups)
        self._group_of: dict[str, ConfigGroup] = {}
        self._regex: dict[str, re.Pattern] = {}
        for group in self.groups:
            for target in group.targets:
                previous = self._group_of.get(target)
                if previous is not None and previous is not group:
                    logger.warning(
                        "compressed-tensors target %r is in config groups %r and %r: the later (%r) "
                        "applies, as in compressed-tensors", target, previous.name, group.name, group.name)
                self._group_of[target] = group
                if target.startswith("re:"):
                    try:
                        self._regex[target] = re.compile(target[3:])
                    except re.error as exc:
                        raise ValueError(
                            f"config_groups.{group.name}.targets entry {target!r} is invalid: bad regex ({exc})"
                        ) from None
        self._targets = sorted(self._group_of, key=lambda t: ("re:" in t, t))

    def match(self, name: str) -> Optional[tuple[str, ConfigGroup]]:
        """(target, group) that quantizes the module ``name``; None when no target matches."""
        for target in self._targets:
            regex = self._regex.get(target)
            if (regex.match(name) is not None) if regex is not None else target == name:
                return target, self._group_of[target]
        return self.class_match()

    def class_match(self) -> Optional[tuple[str, ConfigGroup]]:
        """(target, group) a layer gets from class targets alone: what applies to a layer that no
        name or regex target names (None when no group targets ``Linear``)."""
        for target in self._targets:
            if target in LINEAR_CLASS_TARGETS:
                return target, self._group_of[target]
        return None


# ---------------------------------------------------------------------------
# Online (load-time) quantization targets
# ---------------------------------------------------------------------------

#: Target format name of ``--online_quant_config`` -> spec.
ONLINE_QUANT_FORMATS: dict[str, LayerQuantConfig] = {
    "ptpc_fp8": LayerQuantConfig(
        QuantType.per_Token, DTYPE_KEYS["fp8"], True, "online"
    ),
    "mxfp4": LayerQuantConfig(QuantType.per_1x32, DTYPE_KEYS["fp4x2"], True, "online"),
}


def online_quant_spec(name: str) -> LayerQuantConfig:
    """Spec for an online-quantization target format (``ptpc_fp8`` or ``mxfp4``)."""
    try:
        return ONLINE_QUANT_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"online quant format {name!r} is invalid: must be one of "
            f"{sorted(ONLINE_QUANT_FORMATS)}"
        ) from None
