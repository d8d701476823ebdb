"""From a validated request body to what the engine runs: prompt ids, decoding settings, mode, drafter."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from typing import Any

from kvlab.compress import compressors
from kvlab.engine import Request, generate_lossless
from kvlab.errors import ConfigError
from kvlab.generation.config import GenerationConfig
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.prompt_lookup import NGRAM_PREFIX, split_drafter_name
from kvlab.models import LoadedModel
from kvlab.models.compiled_forward import is_compiled
from kvlab.models.draft_weights import DraftWeights, draft_model
from kvlab.serve.config import Mode, ServeConfig
from kvlab.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

# Prompt text is refused past this many characters per token of the prompt limit, before tokenizing
# (which costs time and memory in proportion to the text). Tokenizers average 3-5 characters a token
# on prose and code; only text made mostly of tokens longer than this could be refused unduly.
MAX_CHARS_PER_TOKEN = 32


Body = CompletionRequest | ChatCompletionRequest


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedBody:
    """A request body as the engine runs it: one engine request per prompt, and what the reply adds.

    Attributes:
        requests: One per prompt (a choice each, in order).
        echo: The reply's text and log-probabilities start with the prompt's.
        prompt_texts: Each prompt's text (what `echo` puts first).
        generate: False for `max_tokens: 0`: the prompt is scored, nothing generated is reported (the
            engine still picks one token, from the prefill's logits, at no extra forward).
    """

    requests: list[Request]
    echo: bool = False
    prompt_texts: tuple[str, ...] = ()
    generate: bool = True

    @property
    def num_tokens(self) -> int:
        """Prompt + max_tokens of every prompt: what the requests may hold at once."""
        return sum(request.num_tokens for request in self.requests)


def resolve(body: Body, loaded: LoadedModel, serve: ServeConfig, default_lossless: LosslessConfig) -> ResolvedBody:
    """Tokenize and check `body` against the server's limits.

    Raises:
        ConfigError: The request breaks a limit or names an unknown drafter or parameter (HTTP 400).
    """
    context = loaded.architecture.max_context
    limit = min(serve.max_prompt_tokens or context, context - 1)
    check_prompt_chars(body, limit)
    check_token_ids(body.stop_token_ids or (), loaded, "stop_token_ids")
    prompts = prompt_ids(body, loaded)
    for prompt in prompts:
        if len(prompt) > limit:
            raise _too_long(len(prompt), limit)
    requests = [_engine_request(body, prompt, loaded, serve, default_lossless) for prompt in prompts]
    total = sum(request.num_tokens for request in requests)
    if total > serve.max_tokens_in_system:
        raise ConfigError(
            f"the prompts and max_tokens ({total} tokens) pass the {serve.max_tokens_in_system} tokens this "
            "server holds at once (max_tokens_in_system)"
        )
    if isinstance(body, ChatCompletionRequest):
        return ResolvedBody(requests)
    texts = tuple(prompt if isinstance(prompt, str) else loaded.decode(prompt, False) for prompt in body.prompts)
    return ResolvedBody(requests, body.echo, texts, generate=body.max_tokens != 0)


def _engine_request(
    body: Body, prompt: list[int], loaded: LoadedModel, serve: ServeConfig, default_lossless: LosslessConfig
) -> Request:
    config = generation_config(body, len(prompt), loaded.architecture.max_context, serve)
    options = body.kvlab
    mode: Mode = options.mode or serve.mode
    if mode == "plain" and (options.drafter is not None or options.drafter_args or options.draft_length is not None):
        raise ConfigError("kvlab.drafter, kvlab.drafter_args and kvlab.draft_length need mode 'lossy' or 'lossless'")
    if mode != "lossless" and options.draft_weights is not None:
        raise ConfigError("kvlab.draft_weights needs mode 'lossless' (only drafting uses other weights)")
    if mode == "lossy" and options.draft_length is not None:
        raise ConfigError("kvlab.draft_length needs mode 'lossless'")
    compressor, lookup = None, None
    if mode != "plain":
        lookup, name = split_drafter_name(options.drafter or serve.drafter)
        if lookup is not None and mode == "lossy":
            raise ConfigError(f"{NGRAM_PREFIX} drafters propose drafts for lossless mode; lossy mode decodes from a "
                              "compressor's cache: name the compressor alone")
        if options.drafter is None and options.drafter_args is None:
            compressor = compressors.create_from_strings(name, list(serve.drafter_args))
        else:
            compressor = compressors.create(name, **(options.drafter_args or {}))
        compressor.check_prompt(len(prompt))
    if mode != "lossless":
        return Request(prompt, config, compressor, cache_salt=options.cache_salt)
    assert compressor is not None
    draft_length = default_lossless.num_draft_tokens if options.draft_length is None else options.draft_length
    lossless = dataclasses.replace(default_lossless, drafter=compressor, num_draft_tokens=draft_length,
                                   prompt_lookup=lookup, draft_weights=_draft_weights(body, serve, default_lossless))
    return Request(prompt, config, lossless=lossless, cache_salt=options.cache_salt)


def _draft_weights(body: Body, serve: ServeConfig, default_lossless: LosslessConfig) -> DraftWeights:
    """The weights a lossless request drafts with: its own choice among those the server built at start-up
    (`build_draft_weights`), else the server's."""
    asked = body.kvlab.draft_weights
    if asked is None:
        return default_lossless.draft_weights
    if asked not in serve.draft_weights_choices:
        raise ConfigError(
            f"kvlab.draft_weights={asked!r} is not allowed on this server, which drafts with "
            f"{', '.join(serve.draft_weights_choices)} (--draft-weights, --allowed-draft-weights)"
        )
    return asked


def build_draft_weights(loaded: LoadedModel, serve: ServeConfig) -> None:
    """Make the draft-weight copies requests may name (`ServeConfig.draft_weights_choices`) now, at
    start-up, rather than on the path of the first request that names them (an int8 copy takes seconds
    and memory). `draft_model` keeps one copy per loaded model, which the engine then finds.

    Raises:
        ConfigError: The device or the torch build cannot run weights of one of those kinds.
    """
    for weights in serve.draft_weights_choices:
        draft_model(loaded.model, weights)  # type: ignore[arg-type]


WARM_UP_TOKENS = 16
"""Prompt tokens of the start-up request that compiles a served model's graphs (`compile_forwards_now`)."""


def compile_forwards_now(loaded: LoadedModel, serve: ServeConfig) -> int:
    """With `--compile-forward`, compile the graphs of the served model and of the draft copies requests may
    name now, at start-up (each takes 30 to 75 s on 2 CPU cores), by a short lossless request drafting with
    each; the first requests would wait for them otherwise. Returns how many weight sets it ran."""
    choices = dict.fromkeys(("same", *serve.draft_weights_choices))
    compiled = [weights for weights in choices if is_compiled(draft_model(loaded.model, weights))]  # type: ignore[arg-type]
    prompt = list(range(3, 3 + WARM_UP_TOKENS))
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    for weights in compiled:
        drafter = LosslessConfig(compressors.create("streamingllm", budget=8), 2, draft_weights=weights)  # type: ignore[arg-type]
        generate_lossless(loaded, [prompt], config, drafter)
    return len(compiled)


def generation_config(body: Body, num_prompt: int, context: int, serve: ServeConfig) -> GenerationConfig:
    """The decoding settings `body` asks for, vLLM's sampling extensions included."""
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    max_new_tokens = _max_tokens(body, num_prompt, context, serve)
    _check_min_tokens(body, max_new_tokens)
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        # OpenAI's API samples differently every time unless a seed is given.
        seed=secrets.randbits(63) if body.seed is None else body.seed,
        stop_strings=body.stop_strings,
        ignore_eos=body.ignore_eos or body.kvlab.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        min_tokens=body.min_tokens,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        prefill_chunk_tokens=serve.prefill_chunk_tokens,
    )


def _too_long(num_tokens: int, limit: int) -> ConfigError:
    return ConfigError(f"the prompt has {num_tokens} tokens; this server accepts at most {limit} (max_prompt_tokens)")


def check_prompt_chars(body: Body, limit: int) -> None:
    """Refuse a prompt (chat: all messages together) longer than `limit * MAX_CHARS_PER_TOKEN` characters,
    or a token-id prompt longer than `limit`, before anything is tokenized."""
    if isinstance(body, ChatCompletionRequest):
        lengths = [sum(len(message.text) for message in body.messages)]
    else:
        lengths = []
        for prompt in body.prompts:
            if not isinstance(prompt, str) and len(prompt) > limit:
                raise _too_long(len(prompt), limit)
            lengths.append(len(prompt) if isinstance(prompt, str) else 0)
    num_chars = max(lengths)
    if num_chars > limit * MAX_CHARS_PER_TOKEN:
        raise ConfigError(
            f"the prompt has {num_chars} characters; this server accepts at most {limit * MAX_CHARS_PER_TOKEN} "
            f"({MAX_CHARS_PER_TOKEN} per token of max_prompt_tokens={limit})"
        )


def prompt_ids(body: Body, loaded: LoadedModel) -> list[list[int]]:
    """Completions: each prompt as is (or given as token ids); chat: the messages through the chat template."""
    if isinstance(body, ChatCompletionRequest):
        if not loaded.has_chat_template:
            raise ConfigError(f"model {loaded.name} has no chat template: use /v1/completions")
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text} for m in body.messages]
        encoded: Any = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids: Any = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [[int(i) for i in ids]]
    prompts = []
    for prompt in body.prompts:
        if isinstance(prompt, str):
            prompts.append(loaded.encode_prompt(prompt, raw=True))
        else:
            check_token_ids(prompt, loaded, "prompt token ids")
            prompts.append(list(prompt))
    return prompts


def check_token_ids(token_ids: Sequence[int], loaded: LoadedModel, what: str) -> None:
    """Refuse ids outside the tokenizer's vocabulary, naming `what` carries them.

    Raises:
        ConfigError: Some id is negative or past the vocabulary.
    """
    vocab = len(loaded.tokenizer)
    if any(not 0 <= token < vocab for token in token_ids):
        raise ConfigError(f"{what} must be in 0..{vocab - 1}")


def _asked_max_tokens(body: Body) -> tuple[str, int | None]:
    """The field that limits the tokens generated, and its value (None: not given)."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return "max_completion_tokens", body.max_completion_tokens
    return "max_tokens", body.max_tokens


def _max_tokens(body: Body, num_prompt: int, context: int, serve: ServeConfig) -> int:
    _, asked = _asked_max_tokens(body)
    if asked == 0:  # echo without generating: the engine's one token comes from the prefill's logits
        return 1
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


def _check_min_tokens(body: Body, max_new_tokens: int) -> None:
    """Refuse a `min_tokens` the request cannot generate, as vLLM does, rather than cap it.

    Raises:
        ConfigError: `min_tokens` passes the given `max_tokens` (`max_completion_tokens`), or what the
            request may generate without it (16 for a completion, else up to the server's limit within
            the context left).
    """
    if body.min_tokens == 0:
        return
    field, asked = _asked_max_tokens(body)
    if asked is not None and body.min_tokens > asked:
        raise ConfigError(f"min_tokens={body.min_tokens} is more than {field}={asked}: ask for at most {asked}")
    if asked is None and body.min_tokens > max_new_tokens:
        raise ConfigError(
            f"min_tokens={body.min_tokens} is more than the {max_new_tokens} tokens this request may generate "
            f"without {field}: give {field} >= min_tokens, or ask for at most {max_new_tokens}"
        )


def tokenize(body: TokenizeRequest, loaded: LoadedModel, limit: int) -> list[int]:
    """`/tokenize`: a prompt as is (special tokens added unless told not to), or messages through the chat
    template (no special tokens beyond the template's unless told), within the server's prompt limit.

    Raises:
        ConfigError: The text passes `limit` x `MAX_CHARS_PER_TOKEN` characters (checked first), or
            `limit` tokens; or messages were given for a model without a chat template.
    """
    tokens = _tokenize(body, loaded, limit)
    if len(tokens) > limit:
        raise ConfigError(
            f"the text has {len(tokens)} tokens; this server accepts at most {limit} (max_prompt_tokens, "
            "within the model's context)"
        )
    return tokens


def _tokenize(body: TokenizeRequest, loaded: LoadedModel, limit: int) -> list[int]:
    if body.messages is not None:
        if not loaded.has_chat_template:
            raise ConfigError(f"model {loaded.name} has no chat template: tokenize a prompt instead")
        num_chars = sum(len(message.text) for message in body.messages)
    else:
        num_chars = len(body.prompt or "")
    if num_chars > limit * MAX_CHARS_PER_TOKEN:
        raise ConfigError(
            f"the text has {num_chars} characters; this server accepts at most {limit * MAX_CHARS_PER_TOKEN}"
        )
    if body.messages is None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return [int(i) for i in loaded.tokenizer(body.prompt or "", add_special_tokens=special)["input_ids"]]
    messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text} for m in body.messages]
    text: Any = loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=body.add_generation_prompt, tokenize=False
    )
    return [int(i) for i in loaded.tokenizer(str(text), add_special_tokens=bool(body.add_special_tokens))["input_ids"]]


def detokenize(body: DetokenizeRequest, loaded: LoadedModel) -> str:
    """`/detokenize`: the text of token ids (special tokens spelled out, as vLLM's server does), at most the
    model's context of them."""
    context = loaded.architecture.max_context
    if len(body.tokens) > context:
        raise ConfigError(f"at most {context} token ids (the model's context) per request, got {len(body.tokens)}")
    check_token_ids(body.tokens, loaded, "token ids")
    return loaded.decode(body.tokens, False)

