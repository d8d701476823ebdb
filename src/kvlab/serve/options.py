"""From a validated request body to what the engine runs: prompt ids, decoding settings, mode, drafter."""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import Gauge

from kvlab.compress import compressors
from kvlab.engine import Request
from kvlab.errors import ConfigError
from kvlab.generation.config import GenerationConfig
from kvlab.lossless.config import LosslessConfig
from kvlab.models import LoadedModel
from kvlab.serve.config import Mode, ServeConfig
from kvlab.serve.engine import ServerBusyError
from kvlab.serve.protocol import ChatCompletionRequest, CompletionRequest

# Prompt text is refused past this many characters per token of the prompt limit, before tokenizing
# (which costs time and memory in proportion to the text). Tokenizers average 3-5 characters a token
# on prose and code; only text made mostly of tokens longer than this could be refused unduly.
MAX_CHARS_PER_TOKEN = 32


Body = CompletionRequest | ChatCompletionRequest


def resolve(body: Body, loaded: LoadedModel, serve: ServeConfig, default_lossless: LosslessConfig) -> Request:
    """Tokenize and check `body` against the server's limits.

    Raises:
        ConfigError: The request breaks a limit or names an unknown drafter or parameter (HTTP 400).
    """
    context = loaded.architecture.max_context
    limit = min(serve.max_prompt_tokens or context, context - 1)
    check_prompt_chars(body, limit)
    prompt = prompt_ids(body, loaded)
    if len(prompt) > limit:
        raise _too_long(len(prompt), limit)
    config = GenerationConfig(
        max_new_tokens=_max_tokens(body, len(prompt), context, serve),
        temperature=body.temperature,
        top_p=body.top_p,
        # OpenAI's API samples differently every time unless a seed is given.
        seed=secrets.randbits(63) if body.seed is None else body.seed,
        stop_strings=body.stop_strings,
        ignore_eos=body.kvlab.ignore_eos,
        prefill_chunk_tokens=serve.prefill_chunk_tokens,
    )
    options = body.kvlab
    mode: Mode = options.mode or serve.mode
    if mode == "plain" and (options.drafter is not None or options.drafter_args or options.draft_length is not None):
        raise ConfigError("kvlab.drafter, kvlab.drafter_args and kvlab.draft_length need mode 'lossy' or 'lossless'")
    if mode == "lossy" and options.draft_length is not None:
        raise ConfigError("kvlab.draft_length needs mode 'lossless'")
    compressor = None
    if mode != "plain":
        if options.drafter is None and options.drafter_args is None:
            compressor = compressors.create_from_strings(serve.drafter, list(serve.drafter_args))
        else:
            compressor = compressors.create(options.drafter or serve.drafter, **(options.drafter_args or {}))
    if compressor is not None:
        compressor.check_prompt(len(prompt))
    if len(prompt) + config.max_new_tokens > serve.max_tokens_in_system:
        raise ConfigError(
            f"the prompt ({len(prompt)} tokens) and max_tokens ({config.max_new_tokens}) pass the "
            f"{serve.max_tokens_in_system} tokens this server holds at once (max_tokens_in_system)"
        )
    if mode != "lossless":
        return Request(prompt, config, compressor, cache_salt=options.cache_salt)
    assert compressor is not None
    draft_length = default_lossless.num_draft_tokens if options.draft_length is None else options.draft_length
    lossless = dataclasses.replace(default_lossless, drafter=compressor, num_draft_tokens=draft_length)
    return Request(prompt, config, lossless=lossless, cache_salt=options.cache_salt)


def _too_long(num_tokens: int, limit: int) -> ConfigError:
    return ConfigError(f"the prompt has {num_tokens} tokens; this server accepts at most {limit} (max_prompt_tokens)")


def check_prompt_chars(body: Body, limit: int) -> None:
    """Refuse a prompt (chat: all messages together) longer than `limit * MAX_CHARS_PER_TOKEN` characters,
    or a token-id prompt longer than `limit`, before anything is tokenized."""
    if isinstance(body, ChatCompletionRequest):
        num_chars = sum(len(message.text) for message in body.messages)
    elif isinstance(body.prompt, str):
        num_chars = len(body.prompt)
    elif body.prompt and isinstance(body.prompt[0], str):
        num_chars = len(body.prompt[0])
    else:
        if len(body.prompt) > limit:
            raise _too_long(len(body.prompt), limit)
        return
    if num_chars > limit * MAX_CHARS_PER_TOKEN:
        raise ConfigError(
            f"the prompt has {num_chars} characters; this server accepts at most {limit * MAX_CHARS_PER_TOKEN} "
            f"({MAX_CHARS_PER_TOKEN} per token of max_prompt_tokens={limit})"
        )


def prompt_ids(body: Body, loaded: LoadedModel) -> list[int]:
    """Completions: the prompt as is (or given as token ids); chat: the messages through the chat template."""
    if isinstance(body, ChatCompletionRequest):
        if not loaded.has_chat_template:
            raise ConfigError(f"model {loaded.name} has no chat template: use /v1/completions")
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text} for m in body.messages]
        encoded: Any = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids: Any = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(i) for i in ids]
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        vocab = len(loaded.tokenizer)
        if any(not 0 <= int(token) < vocab for token in prompt):
            raise ConfigError(f"prompt token ids must be in 0..{vocab - 1}")
        return [int(token) for token in prompt]
    text = prompt if isinstance(prompt, str) else str(prompt[0])
    if not text:
        raise ConfigError("the prompt is empty")
    return loaded.encode_prompt(text, raw=True)


def _max_tokens(body: Body, num_prompt: int, context: int, serve: ServeConfig) -> int:
    asked = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        asked = body.max_completion_tokens
    room = context - num_prompt
    if asked is None:
        # As OpenAI: 16 for completions; chat generates until it stops, within the server's limit.
        asked = 16 if isinstance(body, CompletionRequest) else serve.max_tokens_limit
        return max(1, min(asked, room))
    if asked > serve.max_tokens_limit:
        raise ConfigError(
            f"max_tokens={asked} exceeds this server's limit of {serve.max_tokens_limit} (max_tokens_limit)"
        )
    if asked > room:
        raise ConfigError(
            f"the prompt has {num_prompt} tokens; with max_tokens={asked} that exceeds the model's context "
            f"of {context} tokens"
        )
    return asked


class TokenBudget:
    """Prompt + max_tokens of the requests in the system, at most `limit` (thread-safe: the engine's thread
    ends requests)."""

    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit, self.gauge = limit, gauge
        self.num_tokens = 0
        self._lock = threading.Lock()

    def take(self, num_tokens: int) -> Callable[[], None]:
        """Hold `num_tokens`; returns what gives them back (once, however often it is called).

        Raises:
            ServerBusyError: Holding them would pass the limit.
        """
        with self._lock:
            if self.num_tokens + num_tokens > self.limit:
                raise ServerBusyError(
                    f"the server holds {self.num_tokens} of its {self.limit} tokens (max_tokens_in_system) and this "
                    f"request needs {num_tokens} (prompt + max_tokens); retry later or ask for fewer max_tokens"
                )
            self.num_tokens += num_tokens
            self.gauge.set(self.num_tokens)
        held = [num_tokens]

        def release() -> None:
            with self._lock:
                self.num_tokens -= held.pop() if held else 0
                self.gauge.set(self.num_tokens)

        return release
