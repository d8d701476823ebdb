"""Bookkeeping of a batch being decoded: what each row generated, which rows are still running."""

from __future__ import annotations

from collections.abc import Callable

from kvlab.generation.config import GenerationConfig
from kvlab.generation.stopping import StopChecker, StopReason
from kvlab.models import LoadedModel


class BatchRows:
    """Generated tokens and stop reasons of a batch whose finished rows leave it.

    `active[i]` is the request index of the i-th row still in the batch (the caches hold rows in
    that order).
    """

    def __init__(
        self, num_requests: int, checker: StopChecker, on_tokens: Callable[[int, list[int]], None] | None = None
    ) -> None:
        self.checker = checker
        self.on_tokens = on_tokens
        self.generated: list[list[int]] = [[] for _ in range(num_requests)]
        self.reasons: list[StopReason | None] = [None] * num_requests
        self.active = list(range(num_requests))

    def emit(self, row: int, tokens: list[int]) -> int:
        """Append `tokens` to batch row `row` one by one until it stops; returns how many were kept."""
        request = self.active[row]
        kept = len(tokens)
        for count, token in enumerate(tokens, start=1):
            self.generated[request].append(token)
            self.reasons[request] = self.checker.check(self.generated[request])
            if self.reasons[request] is not None:
                kept = count
                break
        if self.on_tokens is not None and kept:
            self.on_tokens(request, tokens[:kept])
        return kept

    def remaining(self, row: int) -> int:
        """Tokens batch row `row` may still generate before its length limit."""
        return self.checker.max_new_tokens - len(self.generated[self.active[row]])

    def running_rows(self) -> list[int]:
        """Batch positions of rows that have not stopped."""
        return [i for i, request in enumerate(self.active) if self.reasons[request] is None]

    def keep(self, rows: list[int]) -> None:
        """Shrink the batch to `rows` (batch positions), as the caches are shrunk."""
        self.active = [self.active[i] for i in rows]

    def reason(self, request: int) -> StopReason:
        return self.reasons[request] or "length"


def batch_rows(
    loaded: LoadedModel,
    config: GenerationConfig,
    num_requests: int,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> BatchRows:
    """Rows of `num_requests` requests that stop as `config` says: on the model's end-of-sequence
    tokens, on stop strings, or at the length limit."""
    checker = StopChecker(
        loaded.eos_token_ids, config.stop_strings, config.max_new_tokens, loaded.decode, config.ignore_eos
    )
    return BatchRows(num_requests, checker, on_tokens)
