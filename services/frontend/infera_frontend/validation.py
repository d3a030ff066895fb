"""OpenAI request validation: pydantic models of the request bodies and pure checks. No I/O.

The models check what the frontend must know to be right (model, messages or prompt, stream,
token limits, n); every other field is allowed and left alone: the frontend forwards the client's
original JSON bytes, it never re-serialises the body.
"""

from __future__ import annotations

import re
from array import array
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import field_validator, model_validator

from infera_common.block_hash import token_array
from infera_common.schemas import Endpoint

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9._:-]")

Number = StrictFloat  # strict floats accept JSON integers too


class ApiError(Exception):
    """A request answered with an OpenAI error: HTTP status + the error object's fields."""

    def __init__(
        self, status: int, message: str, *, type: str | None = None, param: str | None = None,  # noqa: A002
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", param=param, code=code)


# --- request models -----------------------------------------------------------------------------

class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Open):
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if isinstance(self.content, list):
            for part in self.content:
                if part.type == "text" and part.text is None:
                    raise ValueError("a text content part needs 'text'")
        return self


class _Common(_Open):
    model: StrictStr = Field(min_length=1)
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: StrictInt | None = Field(None, gt=0)
    n: StrictInt | None = None
    temperature: Number | None = Field(None, ge=0)
    top_p: Number | None = Field(None, gt=0, le=1)
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    seed: StrictInt | None = None
    user: StrictStr | None = None

    @field_validator("n")
    @classmethod
    def _at_least_one(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("n must be at least 1")
        return v


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, gt=0)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


_PROMPT_SHAPES = "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"


class CompletionRequest(_Common):
    # ``Any`` and a check of our own: a typed list would be copied element by element (~0.5 ms for
    # a 16k-token prompt) only to be thrown away
    prompt: Any

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if not isinstance(v, list):
            raise ValueError(_PROMPT_SHAPES)
        first = v[0]
        if isinstance(first, int):
            try:
                return token_array(v)  # checked in one C pass, and kept: the ids travel packed (Parsed.prompt_ids)
            except (TypeError, OverflowError):
                raise ValueError(_PROMPT_SHAPES) from None
        if isinstance(first, str) and set(map(type, v)) == {str}:
            return v
        if isinstance(first, list) and all(type(x) is list and x and _are_tokens(x) for x in v):
            return v
        raise ValueError(_PROMPT_SHAPES)


def _are_tokens(v: list[Any]) -> bool:
    """Token ids: integers in 0 .. 2**32-1, checked in one C pass (the array is thrown away).

    ``true``/``false`` pass as 1/0, as the engines' own (lax) request models take them.
    """
    try:
        token_array(v)
    except (TypeError, OverflowError):
        return False
    return True


REQUEST_MODELS: dict[Endpoint, type[_Common]] = {
    Endpoint.CHAT: ChatCompletionRequest,
    Endpoint.COMPLETIONS: CompletionRequest,
}


# --- checks ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class Parsed:
    """A validated request: its model, the parsed JSON (for templating) and whether it streams."""

    endpoint: Endpoint
    model: str
    stream: bool
    data: dict[str, Any]
    prompt_ids: array | None = None  # a completions prompt of token ids, as a C array (validated)


#: The salt of a request whose ``cache_salt`` is not one string (SGLang takes a list, one per prompt
#: of a batch): no engine's blocks are under it, so the router claims no cache hit for the request.
UNKNOWN_SALT = "\x00 not one salt"


def cache_salt(parsed: Parsed) -> str | None:
    """The request's ``cache_salt`` (vLLM and SGLang keep a salted prompt's KV apart from everyone
    else's), as the router hashes the prompt under it."""
    salt = parsed.data.get("cache_salt")
    if salt is None or type(salt) is str:
        return salt
    return UNKNOWN_SALT


def _param(loc: tuple[Any, ...], data: Any) -> str:
    """The client's field path of an error location (pydantic's union branch tags dropped)."""
    out = ""
    cur = data
    last = len(loc) - 1
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(cur, list) and 0 <= part < len(cur):
            out += f"[{part}]"
            cur = cur[part]
        elif isinstance(cur, dict) and (part in cur or i == last):
            out += ("." if out else "") + str(part)
            cur = cur.get(part)
        # else: a union branch tag such as 'str' or 'list[ContentPart]', not part of the path
    return out


def _error_message(exc: ValidationError, data: Any) -> tuple[str, str | None]:
    """The first validation error as (message, param), in the client's terms."""
    # a union reports one error per branch: the deepest location is the branch the client meant
    err = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
    param = _param(tuple(err["loc"]), data) or None
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err["type"] == "missing":
        return f"'{param}' is a required property", param
    if err["type"] == "extra_forbidden":
        return f"unknown field '{param}'", param
    return (f"{param}: {msg}" if param else msg), param


def parse_body(endpoint: Endpoint, body: bytes) -> Parsed:
    """Parse and validate an OpenAI request body; raises ``ApiError`` (400) with the reason."""
    try:
        data = orjson.loads(body)  # a 16k-token prompt is ~80 kB of JSON: the C parser is 3-5x faster
    except ValueError as exc:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as bad:  # say so: orjson's words ("surrogates not allowed") mislead
            raise invalid(f"The request body is not valid UTF-8 (byte 0x{body[bad.start]:02x} at offset "
                          f"{bad.start}); JSON must be sent as UTF-8.") from None
        raise invalid(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(data, dict):
        raise invalid("The request body must be a JSON object.")
    try:
        req = REQUEST_MODELS[endpoint].model_validate(data)
    except ValidationError as exc:
        message, param = _error_message(exc, data)
        raise invalid(message, param=param) from None
    prompt = getattr(req, "prompt", None)
    return Parsed(endpoint, req.model, req.stream, data, prompt if isinstance(prompt, array) else None)


def request_ids(value: str | None, fresh) -> tuple[str, str]:
    """(the id echoed to the client, the id its request carries to the worker and the engine).

    Absent or empty: one ``fresh()`` id for both. Given: the client's own id, echoed as given and
    carried as ``<id>-<8 hex>``, so that requests sent at once under one id (a client library that
    fixes the header, a retry while the first try still runs) stay apart on the worker, whose
    cancels and frames go by id, and on the engine (vLLM suffixes client ids the same way since
    its PR 27987); the engine's log still shows the client's id. An id of other characters than
    ``REQUEST_ID_RE``'s, or longer, is carried with each of them as ``_``, cut at 128: a proxy's id
    (base64 ``+/=``, braces) is never a reason to refuse the request, as it was until session 22.
    """
    if not value:
        rid = fresh()
        return rid, rid
    safe = value if REQUEST_ID_RE.fullmatch(value) else _NOT_IN_ID.sub("_", value[:128])
    return value, f"{safe}-{fresh()[:8]}"
