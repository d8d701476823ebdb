"""How prompt prefixes are stored and fetched: chunk size, resolutions, when to recompute instead."""

from __future__ import annotations

import dataclasses

from kvlab.errors import ConfigError
from kvlab.store.resolution import RESOLUTIONS, get_resolution


@dataclasses.dataclass(frozen=True)
class PrefixConfig:
    """How prefixes are stored and fetched (each field's help says what it does; `kvlab generate`
    shows the same text)."""

    chunk_tokens: int = dataclasses.field(
        default=256, metadata={"help": "tokens per stored chunk (reuse works in whole chunks)"}
    )
    write: tuple[str, ...] = dataclasses.field(
        default=("exact",), metadata={"help": "resolutions written for every new chunk (empty: only read)"}
    )
    fetch: tuple[str, ...] = dataclasses.field(
        default=("exact",),
        metadata={
            "help": "resolutions the fetcher may use; only bit-exact ones (exact, raw) keep output identical to "
            "recomputation, int8/int4 trade exactness for transfer time"
        },
    )
    allow_recompute: bool = dataclasses.field(
        default=True, metadata={"help": "let the planner recompute chunks when that is faster than fetching them"}
    )
    quality_slack: float = dataclasses.field(
        default=0.1, metadata={"help": "relative cost under which a higher-quality resolution is preferred"}
    )
    prior_bandwidth_bits: float = dataclasses.field(
        default=1e9, metadata={"help": "link throughput (bit/s) assumed before the first transfer is measured"}
    )
    prior_prefill_tokens_per_s: float = dataclasses.field(
        default=500.0, metadata={"help": "recompute speed assumed before a prefill is measured"}
    )
    retry_after_s: float = dataclasses.field(
        default=30.0, metadata={"help": "after the store is found unreachable, skip it for this long"}
    )
    decode_workers: int = dataclasses.field(
        default=2, metadata={"help": "chunks decoded at once (codecs release the GIL in zstd, numpy and torch)"}
    )
    cache_salt: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "namespace of this tenant's keys (like cache_salt of OpenAI-compatible servers): prefixes are "
            "shared only between readers with the same salt, and keys cannot be probed without it"
        },
    )

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be at least 1, got {self.chunk_tokens}")
        if self.decode_workers < 1:
            raise ConfigError(f"decode_workers must be at least 1, got {self.decode_workers}")
        if self.cache_salt is not None and not self.cache_salt:
            raise ConfigError("cache_salt must be None or a non-empty string")
        if not self.fetch:
            raise ConfigError("fetch needs at least one resolution")
        for name in (*self.write, *self.fetch):
            get_resolution(name)
        if self.write and not set(self.fetch) <= set(self.write):
            # A writer that fetches what it never writes is almost certainly a mistake (a reader that
            # writes nothing, `write=()`, fetches what others wrote).
            missing = ", ".join(sorted(set(self.fetch) - set(self.write)))
            raise ConfigError(f"fetch resolutions {missing} are never written; add them to write")

    @classmethod
    def for_decoding(
        cls, fetch: tuple[str, ...] = ("exact",), prefix_draft: str | None = None, **fields: object
    ) -> PrefixConfig:
        """The store a decoder uses: it writes what it fetches, and also the low-bit resolution that
        lossless drafting from a stored prefix reads (`LosslessConfig.prefix_draft`), so that a later
        request can draft from the chunks this one computes. `kvlab generate` and `kvlab serve` both
        build their store settings here."""
        low_bit = (prefix_draft,) if prefix_draft and prefix_draft not in fetch else ()
        return cls(write=fetch + low_bit, fetch=fetch, **fields)  # type: ignore[arg-type]

    @property
    def identical(self) -> bool:
        """Every fetchable resolution restores the original bits."""
        return all(RESOLUTIONS[name].exact for name in self.fetch)
