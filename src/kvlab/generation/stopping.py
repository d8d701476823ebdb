"""When a row of a batch stops generating."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from kvlab.generation.config import GenerationConfig

# "cancelled": the caller withdrew the request (a server's client went away) before it finished.
# "error": something failed the request; its output holds the tokens so far and names the failure.
StopReason = Literal["eos", "stop_string", "length", "cancelled", "error"]


class StopChecker:
    """Decides, token by token, whether one sequence is finished.

    Args:
        config: Its stop rules: `stop_strings`, `max_new_tokens`, `ignore_eos` (end-of-sequence tokens
            do not stop it), `stop_token_ids` (stop it whatever `ignore_eos` says) and `min_tokens`
            (nothing but the length limit stops it before that many tokens).
        eos_token_ids: The model's end-of-sequence tokens.
        decode: Token ids -> text (only used for stop strings).
    """

    def __init__(
        self, config: GenerationConfig, eos_token_ids: tuple[int, ...], decode: Callable[[list[int]], str]
    ) -> None:
        self.ending_token_ids = tuple(sorted({*(() if config.ignore_eos else eos_token_ids), *config.stop_token_ids}))
        self._ending = frozenset(self.ending_token_ids)
        self.stop_strings = config.stop_strings
        self.include_stop = config.include_stop_str_in_output
        self.max_new_tokens = config.max_new_tokens
        self.min_tokens = config.min_tokens
        self.decode = decode
        # A stop string can span at most one token per character, plus a partial token on each side.
        self._tail_tokens = max((len(s) for s in self.stop_strings), default=0) + 2

    def check(self, token_ids: list[int]) -> StopReason | None:
        """Why `token_ids` (everything generated so far, newest last) is finished, or None."""
        if len(token_ids) >= self.min_tokens:
            if token_ids[-1] in self._ending:
                return "eos"
            if self.stop_strings:
                tail = self.decode(token_ids[-self._tail_tokens :])
                if any(stop in tail for stop in self.stop_strings):
                    return "stop_string"
        if len(token_ids) >= self.max_new_tokens:
            return "length"
        return None

    def final_text(self, text: str) -> str:
        """`text` cut before the first stop string it contains (after it with `include_stop_str_in_output`)."""
        return cut_at_stop(text, self.stop_strings, self.include_stop)


def cut_at_stop(text: str, stop_strings: tuple[str, ...], include_stop: bool) -> str:
    """`text` up to its first stop string, without it or (`include_stop`) with it; all of it when none occurs."""
    found = [(text.find(stop), stop) for stop in stop_strings if stop in text]
    if not found:
        return text
    index, stop = min(found)
    return text[: index + len(stop)] if include_stop else text[:index]
