"""When a row of a batch stops generating."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

# "cancelled": the caller withdrew the request (a server's client went away) before it finished.
StopReason = Literal["eos", "stop_string", "length", "cancelled"]


class StopChecker:
    """Decides, token by token, whether one sequence is finished.

    Args:
        eos_token_ids: Tokens that end the sequence (ignored when `ignore_eos`).
        stop_strings: Texts that end the sequence once generated.
        max_new_tokens: Length limit.
        decode: Token ids -> text (only used for stop strings).
        ignore_eos: Do not stop on end-of-sequence tokens.
    """

    def __init__(
        self,
        eos_token_ids: tuple[int, ...],
        stop_strings: tuple[str, ...],
        max_new_tokens: int,
        decode: Callable[[list[int]], str],
        ignore_eos: bool = False,
    ) -> None:
        self.eos_token_ids = frozenset(() if ignore_eos else eos_token_ids)
        self.stop_strings = stop_strings
        self.max_new_tokens = max_new_tokens
        self.decode = decode
        # A stop string can span at most one token per character, plus a partial token on each side.
        self._tail_tokens = max((len(s) for s in stop_strings), default=0) + 2

    def check(self, token_ids: list[int]) -> StopReason | None:
        """Why `token_ids` (everything generated so far, newest last) is finished, or None."""
        if token_ids[-1] in self.eos_token_ids:
            return "eos"
        if self.stop_strings:
            tail = self.decode(token_ids[-self._tail_tokens :])
            if any(stop in tail for stop in self.stop_strings):
                return "stop_string"
        if len(token_ids) >= self.max_new_tokens:
            return "length"
        return None

    def final_text(self, text: str) -> str:
        """`text` cut before the first stop string it contains."""
        cut = min((text.find(stop) for stop in self.stop_strings if stop in text), default=-1)
        return text if cut < 0 else text[:cut]
