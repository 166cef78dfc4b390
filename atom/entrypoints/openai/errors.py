"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a status.

`APIError` is raised anywhere in a handler and turned into that body by the app's
exception handler. `from_validation` names the first offending field of a pydantic error
(malformed JSON is a 400, a schema violation a 422); `from_value_error` turns the engine's
and `SamplingParams`' "field=value is invalid: ..." messages into a 400 naming the field in
the request's own spelling.
"""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

# SamplingParams' field -> the request field a user wrote
_PARAM_NAMES = {"stop_strings": "stop", "prompt_logprobs": "logprobs"}
_FIELD = re.compile(r"^(\w+)(?:\[\d+\])?(?:\[['\"]\w+['\"]\])?=")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"


def from_validation(exc) -> APIError:
    """A pydantic ValidationError -> 400 (body is not JSON) or 422 (naming the field)."""
    errors = exc.errors(include_url=False)
    if any(e["type"] in ("json_invalid", "json_type") for e in errors):
        first = errors[0]
        return APIError(400, f"the request body is not valid JSON: {first['msg']}", param=None,
                        code="invalid_json")
    first = errors[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    parts = []
    for e in errors[:5]:
        where = ".".join(str(p) for p in e["loc"]) or "body"
        value = "" if e["type"] == "missing" else f" (got {e.get('input')!r:.60})"
        parts.append(f"{where}: {e['msg']}{value}")
    if len(errors) > 5:
        parts.append(f"... and {len(errors) - 5} more")
    code = "unknown_field" if first["type"] == "extra_forbidden" else first["type"]
    return APIError(422, "invalid request: " + "; ".join(parts), param=param, code=code)


def from_value_error(exc: Exception, default_param: str | None = None) -> APIError:
    """A ValueError / TypeError of SamplingParams or the engine -> a 400 naming the field."""
    message = str(exc)
    m = _FIELD.match(message)
    param = _PARAM_NAMES.get(m.group(1), m.group(1)) if m else default_param
    if param in ("prompt", "prompts"):
        param = default_param or "prompt"
    return APIError(400, message, param=param)
