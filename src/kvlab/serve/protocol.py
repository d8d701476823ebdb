"""The OpenAI wire format kvlab serves: request bodies (validated, unknown fields refused) and replies.

Requests carry kvlab's own options in one field, `"kvlab": {...}` (`extra_body={"kvlab": {...}}` with
the openai client). Fields of the OpenAI API that kvlab does not implement are accepted only at their
neutral value (e.g. `n=1`, `presence_penalty=0`), so no request is silently served differently from
what it asked for.

A body is parsed within fixed bounds before pydantic sees it (`parse_body`): UTF-8 JSON of at most
`MAX_BODY_BYTES`, an object nested at most `MAX_JSON_DEPTH` deep with at most `MAX_JSON_VALUES`
values, integers of at most `MAX_INT_DIGITS` digits and finite numbers only; the strings and lists
pydantic then builds are bounded too.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvlab.generation.logprobs import MAX_TOP_LOGPROBS
from kvlab.serve.config import Mode

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 1024
MAX_SALT_CHARS = 256
MAX_BODY_BYTES = 16 << 20
# The deepest valid body nests 5 levels (body > messages > message > content > part).
MAX_JSON_DEPTH = 32
# Every 64-bit integer fits (2**64 has 20 digits); longer ones cost quadratic time to convert.
MAX_INT_DIGITS = 20
# Array elements and object members in all (a prompt of token ids is one value per token).
MAX_JSON_VALUES = 1 << 20
MAX_CHAT_MESSAGES = 2048
MAX_PROMPTS = 64
MAX_STOP_TOKEN_IDS = 64
MAX_DRAFTER_ARGS = 16
MAX_OPTION_CHARS = 64
JSON_MEDIA_TYPE = "application/json"


class BodyError(ValueError):
    """A request body outside the parser's bounds, or not a JSON object (HTTP 400)."""


class _Refused:
    """What the parser's hooks put in place of a number it refuses; `parse_body` then says where."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _NumberHooks:
    """`json.loads` hooks that stand refused numbers in for `_Refused` markers, and count them."""

    def __init__(self) -> None:
        self.num_refused = 0

    def integer(self, text: str) -> int | _Refused:
        digits = len(text.lstrip("-"))
        return int(text) if digits <= MAX_INT_DIGITS else self._refuse(
            f"integers are limited to {MAX_INT_DIGITS} digits, got one of {digits}")

    def real(self, text: str) -> float | _Refused:
        value = float(text)
        return value if math.isfinite(value) else self._refuse(f"{text[:32]} is out of the range of a double")

    def constant(self, text: str) -> _Refused:
        return self._refuse(f"{text} is not a JSON number")

    def _refuse(self, reason: str) -> _Refused:
        self.num_refused += 1
        return _Refused(reason)


# A JSON string with its escapes (the unrolled form: linear, at C speed, on a long prompt).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_ONE_BRACKET = bytes.maketrans(b"{}", b"[]")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, within the bounds above.

    Its depth and size are measured on its brackets and commas before anything is built; numbers are
    checked as they are parsed, and the first one refused is reported with where it is.

    Raises:
        BodyError: Not UTF-8 JSON, not an object, nested deeper than `MAX_JSON_DEPTH`, holding more
            than `MAX_JSON_VALUES` values, or a number the bounds refuse (`kvlab.drafter_args.seed: ...`).
    """
    _check_structure(raw)
    hooks = _NumberHooks()
    try:
        data = json.loads(raw, parse_int=hooks.integer, parse_float=hooks.real, parse_constant=hooks.constant)
    except RecursionError:  # unbalanced brackets the structure check let through; the C scanner's guard
        raise BodyError(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise BodyError(f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise BodyError("the body must be a JSON object")
    if hooks.num_refused:
        _report_refused(data)
    return data


def _check_structure(raw: bytes) -> None:
    """Values (commas outside strings) and depth (brackets outside strings) of `raw`, before parsing."""
    structure = _JSON_STRING.sub(b"", raw)
    if structure.count(b",") >= MAX_JSON_VALUES:
        raise BodyError(f"the body holds more than {MAX_JSON_VALUES} JSON values")
    brackets = structure.translate(_ONE_BRACKET, _NOT_BRACKETS)
    # Each pass takes away the innermost pairs, one level (replace does not rescan what it made);
    # unbalanced brackets are left for the parser to report.
    for _ in range(MAX_JSON_DEPTH):
        if b"[]" not in brackets:
            return
        brackets = brackets.replace(b"[]", b"")
    if b"[]" in brackets:
        raise BodyError(f"the body nests deeper than {MAX_JSON_DEPTH} levels")


def _report_refused(data: dict[str, Any]) -> None:
    """Raise for the first refused number, naming its path (walked without recursion)."""
    stack: list[tuple[dict[str, Any] | list[Any], tuple[str, ...]]] = [(data, ())]
    while stack:
        container, path = stack.pop()
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in items:
            if isinstance(value, (dict, list)):
                stack.append((value, (*path, str(key))))
            elif isinstance(value, _Refused):
                raise BodyError(f"{'.'.join((*path, str(key)))}: {value.reason}")
    raise AssertionError("a number was refused but is not in the body")


def is_json_media_type(content_type: str | None) -> bool:
    """Whether a Content-Type header is `application/json`, alone or with `charset=utf-8`."""
    if content_type is None:
        return False
    media_type, *parameters = (part.strip().lower() for part in content_type.split(";"))
    if media_type != JSON_MEDIA_TYPE:
        return False
    return all(parameter.replace(" ", "") in ("charset=utf-8", 'charset="utf-8"') for parameter in parameters)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class KvlabOptions(BaseModel):
    """kvlab's per-request options; the server's flags give the defaults.

    Attributes:
        mode: plain (full cache), lossy (decode from the drafter's compressed cache) or lossless
            (draft from it, verify with the full cache: the plain output, token for token when greedy).
        drafter: Compressor name (see `kvlab ls`); `drafter_args` its parameters.
        draft_length: Tokens drafted per round, or "auto" (`num_draft_tokens` in kvlab's code).
        cache_salt: Prefix-store namespace: only requests with the same salt share stored prefixes.
        ignore_eos: Keep generating past end-of-sequence tokens (as the top-level `ignore_eos`).
    """

    model_config = ConfigDict(extra="forbid")
    mode: Mode | None = None
    drafter: str | None = Field(default=None, max_length=64)
    drafter_args: dict[str, int | float | bool | str] | None = None
    draft_length: int | Literal["auto"] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)
    ignore_eos: bool = False

    @model_validator(mode="after")
    def _check(self) -> KvlabOptions:
        if isinstance(self.draft_length, int) and not isinstance(self.draft_length, bool) and self.draft_length < 1:
            raise ValueError(f"kvlab.draft_length must be a positive integer or 'auto', got {self.draft_length}")
        args = self.drafter_args or {}
        if len(args) > MAX_DRAFTER_ARGS:
            raise ValueError(f"kvlab.drafter_args takes at most {MAX_DRAFTER_ARGS} parameters")
        for key, value in args.items():
            if len(key) > MAX_OPTION_CHARS or (isinstance(value, str) and len(value) > MAX_OPTION_CHARS):
                raise ValueError(f"kvlab.drafter_args names and texts are limited to {MAX_OPTION_CHARS} characters")
        return self


# vLLM's sampling extensions that kvlab takes only at their neutral value: name -> (neutral values, wording).
NEUTRAL_ONLY: dict[str, tuple[tuple[float, ...], str]] = {
    "repetition_penalty": ((1.0,), "1.0"),
    "top_k": ((-1, 0), "-1 or 0 (no top-k filtering)"),
    "min_p": ((0.0,), "0"),
    "presence_penalty": ((0.0,), "0"),
    "frequency_penalty": ((0.0,), "0"),
}


class _Common(BaseModel):
    """Fields both endpoints share: OpenAI's, then vLLM's extensions (top level, as vLLM takes them)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, max_length=MAX_OPTION_CHARS * 4)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_OPTION_CHARS * 4)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    kvlab: KvlabOptions = Field(default_factory=KvlabOptions)

    @model_validator(mode="after")
    def _neutral(self) -> _Common:
        if self.n != 1:
            raise ValueError("n: only n=1 is supported (send several prompts to /v1/completions instead)")
        for name, (neutral, wording) in NEUTRAL_ONLY.items():
            if getattr(self, name) not in neutral:
                raise ValueError(f"{name}={getattr(self, name)} is not supported: only {wording}")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if any(not stop for stop in self.stop_strings):
            raise ValueError("stop strings must not be empty")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(len(stop) > MAX_STOP_CHARS for stop in self.stop_strings):
            raise ValueError(f"stop strings are limited to {MAX_STOP_CHARS} characters")
        if any(token < 0 for token in self.stop_token_ids or ()):
            raise ValueError("stop_token_ids must be token ids (>= 0)")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


Prompt = str | list[int]
PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


class CompletionRequest(_Common):
    """`POST /v1/completions`: each prompt is tokenized as is (no chat template) and makes one choice."""

    prompt: Any
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> list[Prompt]:
        """The prompts, from any of the shapes OpenAI's and vLLM's servers take."""
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(_is_token_id(token) for token in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(
            isinstance(item, str) or (isinstance(item, list) and all(_is_token_id(token) for token in item))
            for item in prompt
        ):
            prompts = prompt
        else:
            raise ValueError(f"must be {PROMPT_SHAPES}")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        if any(len(item) == 0 for item in prompts):
            raise ValueError("a prompt is empty")
        return prompts

    @model_validator(mode="after")
    def _completion(self) -> CompletionRequest:
        if self.suffix is not None or self.best_of not in (None, 1):
            raise ValueError("suffix and best_of are not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 needs echo=true (it scores the prompt without generating)")
        return self

    @property
    def prompts(self) -> list[Prompt]:
        return list(self.prompt)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(default=None, max_length=MAX_OPTION_CHARS * 4)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    """`POST /v1/chat/completions`: the messages go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self


class TokenizeRequest(BaseModel):
    """`POST /tokenize`, as vLLM's server takes it: a prompt, or chat messages through the template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, max_length=MAX_OPTION_CHARS * 4)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_CHAT_MESSAGES)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages, not both")
        return self


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: token ids back to text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, max_length=MAX_OPTION_CHARS * 4)
    tokens: list[int]
