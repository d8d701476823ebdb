"""From a request's engine events to its reply: one choice per prompt, whole or streamed.

A body with several prompts runs them as several engine requests; their events arrive tagged with the
choice's index, interleaved. `ChoiceReply` turns one choice's events into its reply fields (text
increments that never take back a stop string, the prompt first with `echo`, log-probabilities); the
route's two loops (`complete`, `stream`) gather them.
"""

from __future__ import annotations

from typing import Any

from kvlab.engine import Request as EngineRequest
from kvlab.generation.logprobs import TokenLogprobs
from kvlab.generation.text import TextDeltas
from kvlab.models import LoadedModel
from kvlab.serve.options import ResolvedBody
from kvlab.serve.replies import Reply, Scored, TokenStrings, chat_logprobs, completion_logprobs, usage
from kvlab.serve.request import FinishedEvent, RequestStats, TokensEvent


class ChoiceReply:
    """One prompt's choice: what each of its events adds to the reply.

    Args:
        index: The choice's index (the prompt's position in the body).
        reply: The reply it is part of.
        resolved: The whole body (echo, prompt texts, whether tokens are generated).
        loaded: The model (detokenizer).
        strings: Token texts for log-probabilities.
    """

    def __init__(
        self, index: int, reply: Reply, resolved: ResolvedBody, loaded: LoadedModel, strings: TokenStrings
    ) -> None:
        self.index, self.reply, self.strings = index, reply, strings
        self.request: EngineRequest = resolved.requests[index]
        config = self.request.config
        self.echo_text = resolved.prompt_texts[index] if resolved.echo else None
        self.generate = resolved.generate
        self.wants_logprobs = config.logprobs is not None
        self.deltas = TextDeltas(
            lambda ids: loaded.decode(ids, config.skip_special_tokens), config.stop_strings,
            config.include_stop_str_in_output,
        )
        self.num_tokens = 0
        self.started = False
        self.text_offset = 0

    # ----- streamed

    def on_tokens(self, event: TokensEvent) -> dict[str, Any] | None:
        """The chunk choice for tokens that are not the last (None: nothing to send yet). The first
        always makes a chunk, so a client's first-token time is the server's."""
        if not self.generate:
            return None
        self.num_tokens += len(event.token_ids)
        text = self.deltas.push(event.token_ids)
        if self.started and not text and not self.wants_logprobs:
            return None
        return self._chunk_choice(text, event.token_ids, event.logprobs, event.prompt_logprobs, None)

    def on_finished(self, event: FinishedEvent) -> dict[str, Any]:
        """The last chunk choice: the rest of the text with `finish_reason`."""
        output = event.output
        last = event.last_token_ids if self.generate else []
        self.num_tokens += len(last)
        text = self.deltas.push(last) + self.deltas.finish(output.text) if self.generate else ""
        scores = None if output.logprobs is None or not last else output.logprobs.tail(len(last))
        prompt_scores = output.prompt_logprobs if not self.started else None
        return self._chunk_choice(text, last, scores, prompt_scores, finish_reason(event, self.generate))

    def usage_so_far(self) -> dict[str, Any]:
        """`continuous_usage_stats`: this choice's tokens so far."""
        return usage(len(self.request.prompt), self.num_tokens)

    def _chunk_choice(
        self, text: str, token_ids: list[int], scores: TokenLogprobs | None, prompt_scores: TokenLogprobs | None,
        reason: str | None,
    ) -> dict[str, Any]:
        first = not self.started
        self.started = True
        runs = []
        if first and self.echo_text is not None:
            text = self.echo_text + text
            if prompt_scores is not None:
                runs.append(Scored(list(self.request.prompt), prompt_scores, unscored_first=True))
        if scores is not None:
            runs.append(Scored(token_ids, scores))
        logprobs = self._logprobs(runs, scores)
        return self.reply.choice(self.index, text, reason, logprobs, stream=True, role=first)

    # ----- whole

    def whole(self, event: FinishedEvent) -> dict[str, Any]:
        """The choice of a reply that is not streamed."""
        output = event.output
        text = output.text if self.generate else ""
        runs = []
        if self.echo_text is not None:
            text = self.echo_text + text
            if output.prompt_logprobs is not None:
                runs.append(Scored(list(self.request.prompt), output.prompt_logprobs, unscored_first=True))
        scores = output.logprobs if self.generate else None
        if scores is not None:
            runs.append(Scored(output.token_ids, scores))
        return self.reply.choice(self.index, text, finish_reason(event, self.generate), self._logprobs(runs, scores))

    def _logprobs(self, runs: list[Scored], scores: TokenLogprobs | None) -> dict[str, Any] | None:
        if not self.wants_logprobs:
            return None
        if self.reply.chat:
            return chat_logprobs(scores or TokenLogprobs(), self.strings)
        shaped = completion_logprobs(runs, self.strings, self.text_offset)
        if shaped["text_offset"]:
            self.text_offset = shaped["text_offset"][-1] + len(shaped["tokens"][-1])
        return shaped


def finish_reason(event: FinishedEvent, generate: bool = True) -> str:
    return "length" if event.output.stop_reason == "length" or not generate else "stop"


def total_usage(events: list[FinishedEvent], generate: bool) -> dict[str, Any]:
    """The reply's usage: every choice's prompt and generated tokens."""
    stats = [event.stats for event in events]
    completion = sum(s.completion_tokens for s in stats) if generate else 0
    return usage(sum(s.prompt_tokens for s in stats), completion, sum(s.cached_tokens for s in stats))


def kvlab_figures(stats: list[RequestStats]) -> dict[str, Any] | list[dict[str, Any]]:
    """The reply's `kvlab` field: the request's figures, or a list of them (one per choice) for several prompts."""
    figures = [s.to_dict() for s in stats]
    return figures[0] if len(figures) == 1 else figures
