"""Which resolution to fetch each prefix chunk at, or whether to recompute it: pure cost arithmetic.

The fetch pipeline has two stages, transfer then decode, working on different chunks at once, so a
run of fetched chunks ends when the slower stage finishes its last chunk. Chunks not fetched are
recomputed after the fetched ones (attention needs everything before them), by the model, one forward.
Time to first token of a plan = pipeline finish + recompute of the rest (+ the prompt's own suffix,
the same for every plan, left out).

Per chunk the plan takes the resolution whose slower stage is cheapest; resolutions within
`quality_slack` of that cost count as equally fast and the highest quality among them wins. Then it
picks how many leading chunks to fetch, comparing every cut against recomputing the rest.
"""

from __future__ import annotations

import dataclasses

RECOMPUTE = "recompute"


@dataclasses.dataclass(frozen=True)
class ResolutionCost:
    """Expected cost of fetching one chunk at one resolution.

    Attributes:
        name: The resolution.
        quality: Higher is closer to the original.
        nbytes: Bytes on the wire.
        decode_s: Seconds to decode and restore it.
    """

    name: str
    quality: int
    nbytes: float
    decode_s: float


def pipeline_seconds(stages: list[tuple[float, float]], latency_s: float = 0.0) -> float:
    """Finish time of a two-stage pipeline (transfer_s, decode_s) per item, in order."""
    transferred = decoded = 0.0
    for transfer_s, decode_s in stages:
        transferred += latency_s + transfer_s
        decoded = max(decoded, transferred) + decode_s
    return decoded


def choose_resolution(
    options: list[ResolutionCost], bandwidth_bytes_per_s: float, quality_slack: float
) -> ResolutionCost:
    """The option with the cheapest bottleneck stage, the best quality among near-ties."""
    if not options:
        raise ValueError("no resolution to choose from")

    def bottleneck(option: ResolutionCost) -> float:
        return max(option.nbytes / bandwidth_bytes_per_s, option.decode_s)

    cheapest = min(bottleneck(option) for option in options)
    near = [option for option in options if bottleneck(option) <= cheapest * (1 + quality_slack)]
    return max(near, key=lambda option: (option.quality, -bottleneck(option)))


def plan_chunks(
    options: list[list[ResolutionCost]],
    recompute_s: list[float],
    bandwidth_bytes_per_s: float,
    latency_s: float = 0.0,
    quality_slack: float = 0.1,
    allow_recompute: bool = True,
) -> list[str]:
    """A resolution name (or `RECOMPUTE`) for each chunk, minimizing the time until all are in place.

    Args:
        options: Per chunk, the resolutions available for it (an empty list: not stored).
        recompute_s: Per chunk, seconds to recompute it after the chunks before it.
        bandwidth_bytes_per_s: Expected link throughput.
        latency_s: Per-request round trip.
        quality_slack: Relative cost difference under which the higher-quality resolution wins.
        allow_recompute: False fetches every chunk that is stored, however slow.
    """
    chosen = [choose_resolution(choice, bandwidth_bytes_per_s, quality_slack) if choice else None for choice in options]
    # Fetching stops at the first chunk not stored: everything after it must be recomputed anyway.
    fetchable = next((index for index, option in enumerate(chosen) if option is None), len(chosen))
    stages = [
        (option.nbytes / bandwidth_bytes_per_s, option.decode_s) for option in chosen[:fetchable] if option is not None
    ]
    best_cut, best_s = fetchable, float("inf")
    cuts = range(fetchable + 1) if allow_recompute else [fetchable]
    for cut in cuts:
        seconds = pipeline_seconds(stages[:cut], latency_s) + sum(recompute_s[cut:])
        # Ties go to fetching more: it spends no compute.
        if seconds < best_s or (seconds == best_s and cut > best_cut):
            best_cut, best_s = cut, seconds
    return [
        option.name if option is not None and index < best_cut else RECOMPUTE for index, option in enumerate(chosen)
    ]
