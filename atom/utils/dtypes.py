"""`dtype=` of `LLM` / `--dtype` of the CLI: which floating type the model runs in.

"auto" keeps `Config.torch_dtype` (the checkpoint's dtype, as the guide says: float32 for
the embedded model, so a CPU runs it in fp32). The others force one of the three types the
engine runs, on a CPU as on a GPU (weights are converted as they load; the KV cache takes
the same type).
"""
from __future__ import annotations

import torch

DTYPE_NAMES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def parse_dtype(value, field: str = "dtype") -> torch.dtype | None:
    """A name of `DTYPE_NAMES` or one of `DTYPES` -> torch.dtype; "auto" (or None) -> None."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value in DTYPES:
            return value
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
    raise ValueError(f"{field}={value!r} is invalid: choose one of {', '.join(map(repr, DTYPE_NAMES))} "
                     "or torch.bfloat16 / torch.float16 / torch.float32")
