"""Which attention layers of an HF config use a sliding window, and how wide.

transformers configs say it two ways: `layer_types` (Qwen2/3, GPT-OSS, Gemma-style: one
"sliding_attention" / "full_attention" entry per layer, the window in `sliding_window`), or
a bare `sliding_window` that applies to every layer (Mistral). A layer type this engine
cannot attend is refused with its name rather than run as full attention.
"""
from __future__ import annotations

KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_window_of(cfg, layer_idx: int) -> int | None:
    """The window W of layer `layer_idx` (its queries see the last W tokens, themselves
    included), or None for full causal attention."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        kind = types[layer_idx]
        if kind not in KNOWN_LAYER_TYPES:
            raise ValueError(f"layer_types[{layer_idx}]={kind!r} is not supported: this build runs "
                             f"{', '.join(KNOWN_LAYER_TYPES)}")
        if kind == "full_attention":
            return None
        if not window:
            raise ValueError(f"layer_types[{layer_idx}]='sliding_attention' needs sliding_window, "
                             f"got {window!r}")
        return int(window)
    return int(window) if window else None
