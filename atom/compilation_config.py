"""Compilation and CUDA-graph settings: `CompilationLevel`, `CUDAGraphMode`, `CompilationConfig`
(re-exported by `atom.config`, where the guide places them)."""

from __future__ import annotations

import bisect
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from atom.config_checks import _check_bool, _check_int, _check_int_list, _invalid, _is_int

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# compilation
# ---------------------------------------------------------------------------


class CompilationLevel:
    """Integer constants for ``CompilationConfig.level``."""

    NO_COMPILATION = 0
    DYNAMO_AS_IS = 1
    DYNAMO_ONCE = 2
    PIECEWISE = 3


class CUDAGraphMode(enum.Enum):
    """How CUDA graphs are captured.

    Single modes apply to every batch. The two tuple modes name
    ``(decode_mode, mixed_mode)``: the first for pure-decode batches, the second
    for mixed prefill/decode batches.

    ``FULL_AND_TR_HYBRID`` is *recorded* as ``TR_HYBRID`` by the native runner
    (decode replays token graphs too, no full decode graph): see
    :meth:`native_mode`. :meth:`decode_mode` / :meth:`mixed_mode` report the
    declared tuple.
    """

    NONE = 0
    TR_HYBRID = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_TR_HYBRID = (FULL, TR_HYBRID)

    def separate_routine(self) -> bool:
        """Whether decode and mixed batches use different routines."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> "CUDAGraphMode":
        """Mode used for pure-decode batches."""
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> "CUDAGraphMode":
        """Mode used for mixed prefill/decode batches."""
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def uses_tr_hybrid(self) -> bool:
        """Whether this mode records token graphs."""
        return CUDAGraphMode.TR_HYBRID in (self.decode_mode(), self.mixed_mode())

    def has_full_cudagraphs(self) -> bool:
        """Whether this mode includes a full CUDA graph."""
        return CUDAGraphMode.FULL in (self.decode_mode(), self.mixed_mode())

    def native_mode(self) -> "CUDAGraphMode":
        """The mode the native runner records (``FULL_AND_TR_HYBRID`` -> ``TR_HYBRID``)."""
        if self is CUDAGraphMode.FULL_AND_TR_HYBRID:
            return CUDAGraphMode.TR_HYBRID
        return self

    @classmethod
    def parse(cls, value: Any) -> "CUDAGraphMode":
        """Accept a member, its name (any case) or its value."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        try:
            return cls(tuple(value) if isinstance(value, list) else value)
        except (ValueError, TypeError):
            raise _invalid(
                "cudagraph_mode", value, f"must be one of {list(cls.__members__)}"
            ) from None


PIECEWISE_SPLITTING_OPS = ["aiter.unified_attention_with_output", "aiter.mla_attention"]


@dataclass
class CompilationConfig:
    """torch.compile and CUDA graph settings."""

    level: int = 0
    use_cudagraph: bool = True
    cudagraph_capture_sizes: Optional[list[int]] = None
    cuda_graph_sizes: list[int] = field(default_factory=list)
    debug_dump_path: str = ""
    cache_dir: str = ""
    use_inductor: bool = True
    cudagraph_mode: Optional[CUDAGraphMode] = None
    splitting_ops: Optional[list[str]] = None
    cudagraph_copy_inputs: bool = False
    compile_sizes: Optional[list[Union[int, str]]] = None
    inductor_compile_config: dict = field(default_factory=dict)

    def __post_init__(self):
        _check_int("level", self.level, 0, 3)
        for name in ("use_cudagraph", "use_inductor", "cudagraph_copy_inputs"):
            _check_bool(name, getattr(self, name))
        for name in ("debug_dump_path", "cache_dir"):
            if not isinstance(getattr(self, name), str):
                raise _invalid(name, getattr(self, name), "must be a string")
        if not isinstance(self.inductor_compile_config, dict):
            raise _invalid(
                "inductor_compile_config", self.inductor_compile_config, "must be a dict"
            )

        self.cuda_graph_sizes = _check_int_list(
            "cuda_graph_sizes", self.cuda_graph_sizes, allow_empty=True
        ) or [512]
        if self.cudagraph_capture_sizes is not None:
            sizes = _check_int_list("cudagraph_capture_sizes", self.cudagraph_capture_sizes)
            self.cudagraph_capture_sizes = sorted(set(sizes))

        if self.cudagraph_mode is not None:
            self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode)
        if self.splitting_ops is not None and not (
            isinstance(self.splitting_ops, (list, tuple))
            and all(isinstance(op, str) and op for op in self.splitting_ops)
        ):
            raise _invalid("splitting_ops", self.splitting_ops, "must be a list of op names")
        if self.compile_sizes is not None:
            ok = isinstance(self.compile_sizes, (list, tuple)) and all(
                (_is_int(s) and s >= 1) or s == "cudagraph_capture_sizes"
                for s in self.compile_sizes
            )
            if not ok:
                raise _invalid(
                    "compile_sizes",
                    self.compile_sizes,
                    "must be a list of integers >= 1 and/or 'cudagraph_capture_sizes'",
                )

        if self.level == CompilationLevel.PIECEWISE:
            if self.cudagraph_mode is None:
                self.cudagraph_mode = CUDAGraphMode.TR_HYBRID
            if self.splitting_ops is None:
                self.splitting_ops = list(PIECEWISE_SPLITTING_OPS)
        self._capture_sizes = self.init_with_cudagraph_sizes()

    def init_with_cudagraph_sizes(self) -> list[int]:
        """Final CUDA graph capture sizes, ascending.

        ``cudagraph_capture_sizes`` wins when set. Otherwise ``cuda_graph_sizes``:
        one value ``N`` gives ``[1..8] + range(16, N+1, 16)`` (sizes above ``N``
        dropped), several values are used as they are.
        """
        if self.cudagraph_capture_sizes is not None:
            sizes = list(self.cudagraph_capture_sizes)
        elif len(self.cuda_graph_sizes) == 1:
            n = self.cuda_graph_sizes[0]
            sizes = [i for i in range(1, 9) if i <= n] + list(range(16, n + 1, 16))
        else:
            sizes = list(self.cuda_graph_sizes)
        self._capture_sizes = sorted(set(sizes))
        return list(self._capture_sizes)

    @property
    def capture_sizes(self) -> list[int]:
        return list(self._capture_sizes)

    @property
    def max_capture_size(self) -> int:
        return self._capture_sizes[-1] if self._capture_sizes else 0

    def padded_size(self, batch_size: int) -> Optional[int]:
        """Smallest captured size >= ``batch_size``; ``None`` when it is larger than all."""
        _check_int("batch_size", batch_size, 1)
        i = bisect.bisect_left(self._capture_sizes, batch_size)
        return self._capture_sizes[i] if i < len(self._capture_sizes) else None

    def get_compile_sizes(self) -> list[int]:
        """``compile_sizes`` with ``"cudagraph_capture_sizes"`` expanded, ascending."""
        out: set[int] = set()
        for s in self.compile_sizes or []:
            out.update(self._capture_sizes if s == "cudagraph_capture_sizes" else [s])
        return sorted(out)


