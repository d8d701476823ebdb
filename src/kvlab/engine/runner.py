"""The runner: the feeds of one tick packed into forwards, one per set of weights, and their logits back.

Every sequence attends over its own cache, so the weights are read once for all of them. Drafting
feeds whose drafter is the target model share the target's forward with the verify feeds; a drafter
with its own weights (bf16, int8, int4) gets a forward of its own, run first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import TypeVar

import torch

from kvlab.cache import Segment, run_packed
from kvlab.generation.feed import Feed
from kvlab.lossless.cost_model import SegmentShape
from kvlab.timing import Stopwatch

Result = TypeVar("Result")


@dataclasses.dataclass(slots=True)
class PackedBatch:
    """One forward over the feeds of several sequences on one set of weights.

    Attributes:
        model: The weights this forward runs.
        feeds: The feeds in packing order: drafting ones first, then verify (and plain) ones.
        segments: One per feed: its cache, its token count and where its new KV goes.
        token_ids: One list per feed; packed, they are the forward's single row of tokens.
        logits_at: [sum of num_logits] indices into the packed tokens whose logits are kept.
        shapes: One per feed: what its segment feeds and reads (for the cost model), as of packing.
    """

    model: torch.nn.Module
    feeds: list[Feed]
    segments: list[Segment]
    token_ids: list[list[int]]
    logits_at: list[int]
    shapes: list[SegmentShape]

    @property
    def num_drafting(self) -> int:
        return sum(feed.drafting for feed in self.feeds)


def pack(model: torch.nn.Module, feeds: list[Feed]) -> PackedBatch:
    """Feeds in packing order (drafting first, each group in the given order) with their logit positions."""
    ordered = [feed for feed in feeds if feed.drafting] + [feed for feed in feeds if not feed.drafting]
    segments: list[Segment] = []
    logits_at: list[int] = []
    end = 0
    for feed in ordered:
        segments.append(Segment(feed.cache, len(feed.token_ids), captured=feed.captured))
        end += len(feed.token_ids)
        logits_at.extend(range(end - feed.num_logits, end))
    shapes = [SegmentShape(segment.num_tokens, segment.cache.stored_tokens()) for segment in segments]
    return PackedBatch(model, ordered, segments, [feed.token_ids for feed in ordered], logits_at, shapes)


def run_batch(batch: PackedBatch, device: torch.device | str) -> tuple[list[torch.Tensor], float]:
    """Run one packed forward; returns each feed's [num_logits, V] logits (in `batch.feeds` order) and
    the seconds it took."""
    clock = Stopwatch(device)
    logits = run_packed(batch.model, batch.segments, batch.token_ids, batch.logits_at)  # type: ignore[arg-type]
    seconds = clock.elapsed()
    per_feed, start = [], 0
    for feed in batch.feeds:
        per_feed.append(logits[start : start + feed.num_logits])
        start += feed.num_logits
    return per_feed, seconds


def group_by_model(
    feeds: list[tuple[torch.nn.Module, Feed]], target: torch.nn.Module
) -> list[tuple[torch.nn.Module, list[Feed]]]:
    """Feeds by the weights they run on: separate drafters first (in order of appearance), the target last."""
    groups: dict[int, tuple[torch.nn.Module, list[Feed]]] = {}
    for model, feed in feeds:
        groups.setdefault(id(model), (model, []))[1].append(feed)
    ordered = [group for key, group in groups.items() if key != id(target)]
    if id(target) in groups:
        ordered.append(groups[id(target)])
    return ordered


def run_to_end(
    model: torch.nn.Module,
    rounds: list[Generator[Feed, torch.Tensor, Result]],
    on_forward: Callable[[PackedBatch, float], None] | None = None,
) -> list[Result]:
    """Run coroutines of feeds on one set of weights until each returns (a drafter's drafts outside the
    engine): every forward packs the next feed of each one still running. `on_forward` is told each
    forward and its seconds. Returns each coroutine's value, in order."""
    results: dict[int, Result] = {}
    feeds: dict[int, Feed] = {}

    def resume(index: int, logits: torch.Tensor | None) -> None:
        try:
            feeds[index] = next(rounds[index]) if logits is None else rounds[index].send(logits)
        except StopIteration as stop:
            feeds.pop(index, None)
            results[index] = stop.value

    for index in range(len(rounds)):
        resume(index, None)
    while feeds:
        order = {id(feed): index for index, feed in feeds.items()}
        batch = pack(model, list(feeds.values()))
        logits, seconds = run_batch(batch, model.device)  # type: ignore[arg-type]
        if on_forward is not None:
            on_forward(batch, seconds)
        for feed, feed_logits in zip(batch.feeds, logits, strict=True):
            resume(order[id(feed)], feed_logits)
    return [results[index] for index in range(len(rounds))]
