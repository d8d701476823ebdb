"""The OpenAI wire format of kvlab's replies: whole replies, streamed chunks, usage, log-probabilities, errors.

Shapes follow OpenAI's API as vLLM's server fills them, so clients written for either read kvlab's:
- completions: `choices[i] = {"index", "text", "logprobs", "finish_reason"}`, with `logprobs =
  {"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (one entry per token; with `echo` the
  prompt's tokens come first and its first token has `null` scores, as nothing predicts it);
- chat: `choices[0] = {"index", "message" | "delta", "logprobs", "finish_reason"}`, with `logprobs =
  {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
A token's alternatives always include the token itself (so there may be N + 1 of them), as vLLM does.

Streams carry the chat role with the first token and `finish_reason` on the last token's chunk, so a
client's first-token and inter-token times are the server's.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

from kvlab.generation.logprobs import TokenLogprobs


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def internal_error_body(error: BaseException) -> dict[str, Any]:
    """The error object of a request the server failed on: its kind, never its traceback (which may show
    paths and values: it goes to the server's log)."""
    message = f"the server failed on this request ({type(error).__name__}); its log has the details"
    return error_body(message, "internal_error")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class TokenStrings:
    """Each token's own text, as log-probabilities name tokens (special tokens spelled out)."""

    def __init__(self, decode: Callable[[list[int], bool], str]) -> None:
        self._text = functools.lru_cache(maxsize=1 << 16)(lambda token: decode([token], False))

    def __call__(self, token_id: int) -> str:
        return str(self._text(token_id))


@dataclasses.dataclass(slots=True)
class Scored:
    """Tokens to report with their scores: `scores` covers them all, or all but an unscored first one
    (a prompt's first token)."""

    token_ids: list[int]
    scores: TokenLogprobs
    unscored_first: bool = False


def completion_logprobs(scored: list[Scored], strings: TokenStrings, text_offset: int) -> dict[str, Any]:
    """The completions shape for runs of tokens in order, their text starting at `text_offset`."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for run in scored:
        scores = iter(zip(run.scores.logprobs, run.scores.top, strict=True))
        for position, token in enumerate(run.token_ids):
            text = strings(token)
            tokens.append(text)
            offsets.append(text_offset)
            text_offset += len(text)
            if position == 0 and run.unscored_first:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            logprob, top = next(scores)
            token_logprobs.append(logprob)
            alternatives = {strings(alternative): value for alternative, value in top}
            alternatives.setdefault(text, logprob)
            top_logprobs.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(scores: TokenLogprobs, strings: TokenStrings) -> dict[str, Any]:
    """The chat shape: one entry per generated token."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = strings(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for token, logprob, top in zip(scores.token_ids, scores.logprobs, scores.top, strict=True):
        item = entry(token, logprob)
        item["top_logprobs"] = [entry(alternative, value) for alternative, value in top]
        content.append(item)
    return {"content": content}


class Reply:
    """What every reply or chunk of one request repeats, and how its choices are shaped."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())

    def _envelope(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def body(self, choices: list[dict[str, Any]], usage_figures: dict[str, Any]) -> dict[str, Any]:
        """A whole reply."""
        return {**self._envelope(stream=False), "choices": choices, "usage": usage_figures}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """One server-sent event (no choices: the usage-only chunk at the end of a stream)."""
        return {**self._envelope(stream=True), "choices": choices}

    def choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None,
        stream: bool = False, role: bool = False,
    ) -> dict[str, Any]:
        """One choice: whole (`stream=False`), or a streamed delta (`role`: the first of its stream)."""
        choice: dict[str, Any] = {"index": index}
        if not self.chat:
            choice["text"] = text
        elif stream:
            choice["delta"] = {"role": "assistant", "content": text} if role else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        return choice
