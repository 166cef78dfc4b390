"""Which device the engine runs on and which kernel backend serves it.

- CPU: the torch reference kernels.
- NVIDIA GPU: the Triton kernels (attention over the paged cache, norm, rotary, ...).
- AMD GPU (ROCm): the same Triton kernels; when `aiter` imports ("aiter"), AITER's kernels
  serve RMSNorm, add + RMSNorm and SiLU-and-mul (`model_ops.kernels_aiter`), Triton the rest.
The choice is logged once (INFO); `ATOM_KERNEL_BACKEND=torch|triton|aiter` forces one. Any
other value, or a backend this machine cannot run (triton / aiter without a GPU, aiter
without the package), is a ValueError when the engine starts (`model_engine.supported`).
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("aiter", "triton", "torch")


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def is_rocm() -> bool:
    return torch.version.hip is not None


def kernel_backend() -> str:
    """The backend for this process: chosen (and logged at INFO) once per value of
    `ATOM_KERNEL_BACKEND`; a value that is no backend, or one this machine cannot run
    (triton / aiter without a GPU, aiter without the package), is a ValueError."""
    return _kernel_backend(os.environ.get("ATOM_KERNEL_BACKEND") or None)


@functools.cache
def _kernel_backend(forced: str | None) -> str:
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"ATOM_KERNEL_BACKEND={forced!r} is invalid: choose one of "
                             f"{', '.join(BACKENDS)} (or unset it to choose by device)")
        if forced == "aiter" and (err := _aiter_import_error()) is not None:
            raise ValueError(f"ATOM_KERNEL_BACKEND='aiter' needs the aiter package, which {err}: "
                             "choose triton or torch")
        if forced != "torch" and not torch.cuda.is_available():
            raise ValueError(f"ATOM_KERNEL_BACKEND={forced!r} needs a GPU and torch sees none: "
                             "choose torch (the CPU reference kernels) or unset it")
        if forced == "triton" and importlib.util.find_spec("triton") is None:
            raise ValueError("ATOM_KERNEL_BACKEND='triton' needs the triton package, which is not "
                             "installed: choose torch or unset it")
        choice, why = forced, "forced by ATOM_KERNEL_BACKEND"
    elif not torch.cuda.is_available():
        choice, why = "torch", "no GPU: torch reference kernels"
    elif is_rocm() and (aiter_err := _aiter_import_error()) is None:
        choice, why = "aiter", "ROCm, aiter imports"
    elif importlib.util.find_spec("triton") is not None:
        choice, why = "triton", f"{'ROCm' if is_rocm() else 'CUDA'} GPU with Triton"
        if is_rocm() and aiter_err != "is not installed":
            logger.warning("aiter %s: using the Triton kernels", aiter_err)
    else:
        choice, why = "torch", "GPU without Triton: torch reference kernels"
    logger.info("kernel backend: %s (%s)", choice, why)
    return choice


kernel_backend.cache_clear = _kernel_backend.cache_clear  # forget the choices (tests, notebooks)


def _aiter_import_error() -> str | None:
    """None when `aiter` imports, else why not (as a clause: "is not installed", ...)."""
    if importlib.util.find_spec("aiter") is None:
        return "is not installed"
    try:
        import aiter  # noqa: F401
    except Exception as e:  # a broken build (ABI, JIT) must not take the engine down: fall back
        return f"failed to import ({type(e).__name__}: {e})"
    return None


def describe() -> str:
    dev = default_device()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    return f"{name} ({dev.type}), torch {torch.__version__}, kernels: {kernel_backend()}"
