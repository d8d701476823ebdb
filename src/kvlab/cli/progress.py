"""Progress bars for long CLI work (the library only calls callbacks)."""

from __future__ import annotations

import sys
from types import TracebackType

from tqdm import tqdm


class TokenProgress:
    """A stderr bar counting generated tokens with live tokens/s; silent when disabled or not a TTY."""

    def __init__(self, total: int, enabled: bool = True, unit: str = "tok") -> None:
        self._bar = tqdm(
            total=total,
            unit=unit,
            file=sys.stderr,
            disable=not enabled or not sys.stderr.isatty(),
            leave=False,
            dynamic_ncols=True,
        )

    def update(self, count: int) -> None:
        self._bar.update(count)

    def __enter__(self) -> TokenProgress:  # noqa: PYI034
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._bar.close()
