"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a status.

`APIError` is raised anywhere in a handler and turned into that body by the app's
exception handler. `from_validation` names the first offending field of a pydantic error
(malformed JSON is a 400, a schema violation a 422) as the user wrote it: the request
model's own field names, with the list indices between them (`messages.0.role`), never the
components pydantic adds for a union's branch (`prompt.list[int].1` is `prompt`), a dict's
key (`logit_bias.5` is `logit_bias`) or an index into the field's value. `from_value_error`
turns the engine's and `SamplingParams`' "field=value is invalid: ..." messages into a 400
naming the field in the request's own spelling.
"""
from __future__ import annotations

import re
import types
import typing
from typing import Any, Union, get_args, get_origin

from fastapi.responses import JSONResponse
from pydantic import BaseModel

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


def from_validation(exc, model: type[BaseModel] | None = None) -> APIError:
    """A pydantic ValidationError -> 400 (body is not JSON) or 422 (naming the field).

    `model`: the request model that was validated, so that `param` is the field the user
    wrote (see `request_field`); without it `param` is pydantic's `loc` as it is."""
    errors = exc.errors(include_url=False)
    if any(e["type"] in ("json_invalid", "json_type") for e in errors):
        first = errors[0]
        return APIError(400, f"the request body is not valid JSON: {first['msg']}", param=None,
                        code="invalid_json")
    first = errors[0]
    param = request_field(first["loc"], model)
    parts = []
    for e in errors[:5]:
        where = ".".join(str(p) for p in e["loc"]) or "body"
        value = "" if e["type"] == "missing" else f" (got {e.get('input')!r:.60})"
        parts.append(f"{where}: {e['msg']}{value}")
    if len(errors) > 5:
        parts.append(f"... and {len(errors) - 5} more")
    code = "unknown_field" if first["type"] == "extra_forbidden" else first["type"]
    return APIError(422, "invalid request: " + "; ".join(parts), param=param, code=code)


def request_field(loc: tuple, model: type[BaseModel] | None) -> str | None:
    """The request field a pydantic error's `loc` points at, in the request's own spelling.

    `loc` is walked along `model`'s annotations: a component naming a model's field (or a
    field the model does not have: the user's own spelling of an unknown field) is kept,
    with the list indices that lead to it (`messages.0.role`); a union's branch name
    (`prompt.str`, `messages.0.content.list[_TextPart]`), a dict's key and the indices into
    a field's own value (`prompt.list[int].1`) are not part of any field's name, so dropped.
    """
    if model is None:
        return ".".join(str(p) for p in loc) or None
    names: list[str] = []
    indices: list[str] = []          # list indices since the last field: kept before a field
    candidates: list[Any] = [model]  # the types the value at this point of `loc` may have
    for p in loc:
        branches: list[Any] = []
        tagged = False
        for t in candidates:
            b, union = _branches(t)
            branches += b
            tagged = tagged or union
        if tagged:   # pydantic names the branch of a union: no part of the field's name
            candidates = branches
            continue
        if isinstance(p, int):
            items = [get_args(t)[0] for t in branches
                     if get_origin(t) in (list, tuple, set, frozenset) and get_args(t)]
            if items:
                indices.append(str(p))
            candidates = items or _dict_values(branches)
            continue
        models = [t for t in branches if isinstance(t, type) and issubclass(t, BaseModel)]
        fields = [m.model_fields[p].annotation for m in models if p in m.model_fields]
        if fields or (models and not _dict_values(branches)):
            names += indices + [p]   # a field, or an unknown one named as the user wrote it
            indices = []
            candidates = fields
        else:                        # a dict's key, or inside a value typed Any
            candidates = _dict_values(branches)
    return ".".join(names) or None


def _branches(t: Any) -> tuple[list[Any], bool]:
    """The types `t` stands for, and whether pydantic validates them as a union of several
    branches (then an error's `loc` names the branch). `Optional[X]` is X, no union."""
    while get_origin(t) is typing.Annotated:
        t = get_args(t)[0]
    if get_origin(t) in (Union, types.UnionType):
        args = [a for a in get_args(t) if a is not type(None)]
        if len(args) > 1:
            return [b for a in args for b in _branches(a)[0]], True
        return _branches(args[0]) if args else ([], False)
    return [t], False


def _dict_values(branches: list[Any]) -> list[Any]:
    return [get_args(t)[1] for t in branches if get_origin(t) is dict and len(get_args(t)) == 2]


def from_value_error(exc: Exception, default_param: str | None = None) -> APIError:
    """A ValueError / TypeError of SamplingParams or the engine -> a 400 naming the field."""
    message = str(exc)
    m = _FIELD.match(message)
    param = _PARAM_NAMES.get(m.group(1), m.group(1)) if m else default_param
    if param in ("prompt", "prompts"):
        param = default_param or "prompt"
    return APIError(400, message, param=param)
