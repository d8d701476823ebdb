"""The OpenAI wire format kvlab serves: request bodies (validated, unknown fields refused) and replies.

Requests carry kvlab's own options in one field, `"kvlab": {...}` (`extra_body={"kvlab": {...}}` with
the openai client). Fields of the OpenAI API that kvlab does not implement are accepted only at their
neutral value (e.g. `n=1`, `presence_penalty=0`), so no request is silently served differently from
what it asked for.

A body is first parsed within fixed bounds (`kvlab.serve.body.parse_body`); the strings and lists
pydantic then builds here are bounded too. Every field is strictly typed: a boolean is not a number, a
number is not a boolean nor a string, and names are never empty.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from kvlab.generation.logprobs import MAX_TOP_LOGPROBS
from kvlab.serve.body import MAX_QUOTED_CHARS
from kvlab.serve.config import DraftWeightsName, Mode

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 1024
MAX_SALT_CHARS = 256
MAX_CHAT_MESSAGES = 2048
# Text parts of one chat message, and of all its messages together: each part is a model pydantic
# builds (about 4 us), so a body of empty parts would otherwise cost seconds of CPU.
MAX_MESSAGE_PARTS = 256
MAX_CHAT_PARTS = 4096
MAX_PROMPTS = 64
MAX_STOP_TOKEN_IDS = 64
MAX_DRAFTER_ARGS = 16
MAX_OPTION_CHARS = 64
# Every model refuses unknown fields and converts nothing (no "1" for 1, no 1 for true, no 2.0 for 2);
# a float field still takes an integer (`"temperature": 1`), as JSON does not tell them apart.
STRICT = ConfigDict(extra="forbid", strict=True)


def _quoted(value: Any) -> str:
    """`value` as an error message may quote it (strings cut short)."""
    text = repr(value)
    return text if len(text) <= MAX_QUOTED_CHARS else text[:MAX_QUOTED_CHARS] + "..."


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class KvlabOptions(BaseModel):
    """kvlab's per-request options; the server's flags give the defaults.

    Attributes:
        mode: plain (full cache), lossy (decode from the drafter's compressed cache) or lossless
            (draft from it, verify with the full cache: the plain output, token for token when greedy in float32).
        drafter: Compressor name (see `kvlab ls`); `drafter_args` its parameters.
        draft_length: Tokens drafted per round, or "auto" (`num_draft_tokens` in kvlab's code).
        cache_salt: Prefix-store namespace: only requests with the same salt share stored prefixes.
        ignore_eos: Keep generating past end-of-sequence tokens (as the top-level `ignore_eos`).
        draft_weights: The weights that draft in lossless mode: the model's own (same) or its bf16,
            int8 or int4 copy, among those the server was started with (`--allowed-draft-weights`).
    """

    model_config = STRICT
    mode: Mode | None = None
    drafter: str | None = Field(default=None, min_length=1, max_length=MAX_OPTION_CHARS)
    drafter_args: dict[str, int | float | bool | str] | None = None
    draft_length: int | Literal["auto"] | None = None
    draft_weights: DraftWeightsName | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)
    ignore_eos: bool = False

    @field_validator("draft_length", mode="before")
    @classmethod
    def _draft_length(cls, value: Any) -> Any:
        # One message for every wrong value, rather than one per member of the union.
        if value is None or value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError(f"must be a positive integer or 'auto', got {_quoted(value)}")

    @field_validator("drafter_args")
    @classmethod
    def _drafter_args(cls, args: dict[str, int | float | bool | str] | None) -> Any:
        if len(args or {}) > MAX_DRAFTER_ARGS:
            raise ValueError(f"takes at most {MAX_DRAFTER_ARGS} parameters")
        for key, value in (args or {}).items():
            if not key:
                raise ValueError("a parameter name is empty")
            if len(key) > MAX_OPTION_CHARS or (isinstance(value, str) and len(value) > MAX_OPTION_CHARS):
                raise ValueError(f"names and texts are limited to {MAX_OPTION_CHARS} characters")
        return args


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

    model_config = STRICT
    model: str | None = Field(default=None, min_length=1, max_length=MAX_OPTION_CHARS * 4)
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
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(default=None, min_length=1, max_length=MAX_OPTION_CHARS * 4)

    @field_validator("content", mode="before")
    @classmethod
    def _num_parts(cls, content: Any) -> Any:
        """At most `MAX_MESSAGE_PARTS` parts, counted before any is built."""
        if isinstance(content, list) and len(content) > MAX_MESSAGE_PARTS:
            raise ValueError(f"at most {MAX_MESSAGE_PARTS} text parts per message, got {len(content)}")
        return content

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


def _num_chat_parts(messages: Any) -> Any:
    """At most `MAX_CHAT_PARTS` text parts in all the messages, counted before any is built (more than
    `MAX_CHAT_MESSAGES` messages are refused by their own bound)."""
    if isinstance(messages, list) and len(messages) <= MAX_CHAT_MESSAGES:
        num_parts = sum(
            len(message["content"]) for message in messages
            if isinstance(message, dict) and isinstance(message.get("content"), list)
        )
        if num_parts > MAX_CHAT_PARTS:
            raise ValueError(f"at most {MAX_CHAT_PARTS} text parts in all the messages, got {num_parts}")
    return messages


ChatMessages = Annotated[
    list[ChatMessage], BeforeValidator(_num_chat_parts), Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
]


class ChatCompletionRequest(_Common):
    """`POST /v1/chat/completions`: the messages go through the model's chat template."""

    messages: ChatMessages
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

    model_config = STRICT
    model: str | None = Field(default=None, min_length=1, max_length=MAX_OPTION_CHARS * 4)
    prompt: str | None = None
    messages: ChatMessages | None = None
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

    model_config = STRICT
    model: str | None = Field(default=None, min_length=1, max_length=MAX_OPTION_CHARS * 4)
    tokens: list[int]
