"""Progress bars for long CLI work (the library only calls callbacks)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

from kvlab.generation.text import TextDeltas


class TokenProgress:
    """A stderr bar counting generated tokens with live tokens/s; silent when disabled or not a TTY.

    Labelled `first_phase` (e.g. "prefill") until the first tokens arrive, then `unit`s are counted.
    """

    def __init__(self, total: int, enabled: bool = True, unit: str = "tok", first_phase: str | None = None) -> None:
        self._bar = tqdm(
            total=total,
            unit=unit,
            desc=first_phase,
            file=sys.stderr,
            disable=not enabled or not sys.stderr.isatty(),
            leave=False,
            dynamic_ncols=True,
        )
        self._started = first_phase is None

    def update(self, count: int) -> None:
        if not self._started:
            self._bar.set_description("decode")
            self._started = True
        self._bar.update(count)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> TokenProgress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._bar.close()


class TextStream:
    """Writes one request's text to `out` as its tokens arrive (a `TokenCallback`).

    Text is only ever appended (`kvlab.generation.text.TextDeltas` decides what is settled), and
    `finish` writes the rest of the final text (cut before a stop string, as the output's text is).
    """

    def __init__(
        self, decode: Callable[[list[int]], str], stop_strings: tuple[str, ...], out: TextIO, request: int = 0
    ) -> None:
        self.deltas = TextDeltas(decode, stop_strings)
        self.out = out
        self.request = request
        self.on_first: Callable[[], None] | None = None

    def __call__(self, request: int, tokens: list[int]) -> None:
        if request != self.request:
            return
        if self.on_first is not None:
            self.on_first()
            self.on_first = None
        delta = self.deltas.push(tokens)
        if delta:
            self.out.write(delta)
            self.out.flush()

    def finish(self, final_text: str) -> None:
        """Write what is left of `final_text` and end the line."""
        self.out.write(self.deltas.finish(final_text) + "\n")
        self.out.flush()
