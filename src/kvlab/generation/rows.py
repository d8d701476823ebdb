"""Bookkeeping of a batch being decoded: what each row generated, which rows are still running."""

from __future__ import annotations

from collections.abc import Callable

from kvlab.generation.config import GenerationConfig
from kvlab.generation.stopping import StopChecker, StopReason
from kvlab.models import LoadedModel


class BatchRows:
    """Generated tokens and stop reasons of a batch whose finished rows leave it.

    `active[i]` is the request index of the i-th row still in the batch (the caches hold rows in
    that order). Requests may join later (`add`, each with its own stop rules) and be forgotten once
    their output was read (`release`), as a server's continuous batch does.
    """

    def __init__(
        self, num_requests: int, checker: StopChecker, on_tokens: Callable[[int, list[int]], None] | None = None
    ) -> None:
        self.checker = checker
        self.on_tokens = on_tokens
        self.checkers: list[StopChecker] = [checker] * num_requests
        self.generated: list[list[int]] = [[] for _ in range(num_requests)]
        self.reasons: list[StopReason | None] = [None] * num_requests
        self.active = list(range(num_requests))

    def add(self, checker: StopChecker | None = None) -> int:
        """A new request stopping by `checker` (default: the batch's); returns its index."""
        self.checkers.append(checker or self.checker)
        self.generated.append([])
        self.reasons.append(None)
        self.active.append(len(self.generated) - 1)
        return len(self.generated) - 1

    def release(self, request: int) -> None:
        """Drop a request's tokens (its index stays taken; a request not stopped yet is cancelled).

        For batches whose rows are their requests (`active` never shrinks), as a lossless run's are.
        """
        self.generated[request] = []
        self.checkers[request] = self.checker
        if self.reasons[request] is None:
            self.reasons[request] = "cancelled"

    def emit(self, row: int, tokens: list[int]) -> int:
        """Append `tokens` to batch row `row` one by one until it stops; returns how many were kept."""
        request = self.active[row]
        kept = len(tokens)
        for count, token in enumerate(tokens, start=1):
            self.generated[request].append(token)
            self.reasons[request] = self.checkers[request].check(self.generated[request])
            if self.reasons[request] is not None:
                kept = count
                break
        if self.on_tokens is not None and kept:
            self.on_tokens(request, tokens[:kept])
        return kept

    def remaining(self, row: int) -> int:
        """Tokens batch row `row` may still generate before its length limit."""
        request = self.active[row]
        return self.checkers[request].max_new_tokens - len(self.generated[request])

    def running_rows(self) -> list[int]:
        """Batch positions of rows that have not stopped."""
        return [i for i, request in enumerate(self.active) if self.reasons[request] is None]

    def keep(self, rows: list[int]) -> None:
        """Shrink the batch to `rows` (batch positions), as the caches are shrunk."""
        self.active = [self.active[i] for i in rows]

    def reason(self, request: int) -> StopReason:
        return self.reasons[request] or "length"


def stop_checker(loaded: LoadedModel, config: GenerationConfig) -> StopChecker:
    """Stops on the model's end-of-sequence tokens, on `config`'s stop strings, or at its length limit."""
    return StopChecker(loaded.eos_token_ids, config.stop_strings, config.max_new_tokens, loaded.decode, config.ignore_eos)


def batch_rows(
    loaded: LoadedModel,
    config: GenerationConfig,
    num_requests: int,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> BatchRows:
    """Rows of `num_requests` requests that stop as `config` says: on the model's end-of-sequence
    tokens, on stop strings, or at the length limit."""
    return BatchRows(num_requests, stop_checker(loaded, config), on_tokens)
