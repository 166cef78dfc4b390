"""Validation helpers shared by the config classes: every invalid value raises
``ValueError("<field>=<value> is invalid: <what is allowed>")``."""

from __future__ import annotations

import math
from typing import Any, Optional


# ---------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------


def _invalid(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _check_int(name: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None):
    if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is not None and hi is not None:
            allowed = f"must be an integer in [{lo}, {hi}]"
        elif lo is not None:
            allowed = f"must be an integer >= {lo}"
        else:
            allowed = "must be an integer"
        raise _invalid(name, value, allowed)


def _check_bool(name: str, value: Any):
    if not isinstance(value, bool):
        raise _invalid(name, value, "must be True or False")


def _check_choice(name: str, value: Any, choices: tuple, allow_none: bool = False):
    if value is None and allow_none:
        return
    if value not in choices:
        extra = " or None" if allow_none else ""
        raise _invalid(name, value, f"must be one of {list(choices)}{extra}")


def _check_int_list(name: str, value: Any, allow_empty: bool = False) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
        _is_int(v) and v >= 1 for v in value
    ):
        raise _invalid(name, value, "must be a list of integers >= 1")
    if not value and not allow_empty:
        raise _invalid(name, value, "must be a non-empty list of integers >= 1")
    return list(value)


