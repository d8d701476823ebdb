"""The OpenAI wire format kvlab serves: request bodies (validated, unknown fields refused) and replies.

Requests carry kvlab's own options in one field, `"kvlab": {...}` (`extra_body={"kvlab": {...}}` with
the openai client). Fields of the OpenAI API that kvlab does not implement are accepted only at their
neutral value (e.g. `n=1`, `presence_penalty=0`), so no request is silently served differently from
what it asked for.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvlab.serve.config import Mode

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_SALT_CHARS = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class KvlabOptions(BaseModel):
    """kvlab's per-request options; the server's flags give the defaults.

    Attributes:
        mode: plain (full cache), lossy (decode from the drafter's compressed cache) or lossless
            (draft from it, verify with the full cache: the plain output, token for token when greedy).
        drafter: Compressor name (see `kvlab ls`); `drafter_args` its parameters.
        draft_length: Tokens drafted per round, or "auto" (`num_draft_tokens` in kvlab's code).
        cache_salt: Prefix-store namespace: only requests with the same salt share stored prefixes.
        ignore_eos: Keep generating past end-of-sequence tokens (fixed-length measurements).
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
        return self


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    kvlab: KvlabOptions = Field(default_factory=KvlabOptions)

    @model_validator(mode="after")
    def _neutral(self) -> _Common:
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias are not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if any(not stop for stop in self.stop_strings):
            raise ValueError("stop strings must not be empty")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    """`POST /v1/completions`: the prompt is tokenized as is (no chat template)."""

    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _single_prompt(self) -> CompletionRequest:
        if self.echo or self.logprobs is not None or self.suffix is not None or self.best_of not in (None, 1):
            raise ValueError("echo, logprobs, suffix and best_of are not supported")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ValueError("one prompt per request (a list of strings must hold exactly one)")
        if not self.prompt:
            raise ValueError("the prompt is empty")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    """`POST /v1/chat/completions`: the messages go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    request_id: str, model: str, chat: bool, text: str, finish_reason: str | None, created: int | None = None
) -> dict[str, Any]:
    """A whole reply (or, with `chunk`-style text, one streamed chunk: see `chunk_body`)."""
    created = created or int(time.time())
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chunk_body(
    request_id: str, model: str, chat: bool, created: int, text: str | None, finish_reason: str | None, first: bool = False
) -> dict[str, Any]:
    """One server-sent event of a streamed reply; `text=None` makes the usage-only chunk (no choices)."""
    if chat:
        chunk: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        if text is None:
            chunk["choices"] = []
            return chunk
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        return chunk
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    chunk["choices"] = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    return chunk
