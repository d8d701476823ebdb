"""A streamed request's text as increments that are never taken back (the CLI's streamed output and the
server's server-sent events both use it)."""

from __future__ import annotations

from collections.abc import Callable

from kvlab.generation.stopping import cut_at_stop


class TextDeltas:
    """Turns a request's tokens, as they arrive, into text increments.

    What could still become a stop string, or an incomplete multi-byte character, is held back until
    the tokens that follow settle it; `finish` gives the rest of the final text (cut at a stop
    string, as the reply's text is). The increments add up to exactly the final text.
    """

    def __init__(
        self, decode: Callable[[list[int]], str], stop_strings: tuple[str, ...], include_stop: bool = False
    ) -> None:
        self.decode = decode
        self.stop_strings = stop_strings
        self.include_stop = include_stop
        self.hold = max((len(stop) for stop in stop_strings), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, tokens: list[int]) -> str:
        """The text that `tokens` settle (possibly empty)."""
        self.tokens.extend(tokens)
        text = self.decode(self.tokens).rstrip("\ufffd")
        # Up to a completed stop string everything is settled; otherwise the tail may still become one.
        if any(stop in text for stop in self.stop_strings):
            settled = cut_at_stop(text, self.stop_strings, self.include_stop)
        else:
            settled = text[: max(len(text) - self.hold, 0)]
        if not settled.startswith(self.sent) or len(settled) <= len(self.sent):
            return ""
        delta, self.sent = settled[len(self.sent) :], settled
        return delta

    def finish(self, final_text: str) -> str:
        """What is left of `final_text` after the increments sent so far."""
        rest = final_text[len(self.sent) :] if final_text.startswith(self.sent) else ""
        self.sent += rest
        return rest
