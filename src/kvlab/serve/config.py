"""What the operator sets when starting `kvlab serve`: limits, per-request defaults, the prefix store."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Literal

from kvlab.errors import ConfigError

Mode = Literal["plain", "lossy", "lossless"]
MODES: tuple[Mode, ...] = ("plain", "lossy", "lossless")
# kvlab.models.DTYPES and DraftWeights, spelled out so that `kvlab serve --help` loads no torch.
Dtype = Literal["float32", "bfloat16", "float16"]
DraftWeightsName = Literal["same", "bf16", "int8"]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclasses.dataclass(frozen=True, slots=True)
class ServeConfig:
    """The server's settings; each field's metadata is its `kvlab serve` help.

    Requests pick their mode, drafter, draft length and cache salt within these; everything that
    touches files, URLs or limits is the operator's alone.
    """

    model: str | None = dataclasses.field(default=None, metadata=_help("embedded alias, .gguf file, model dir or cached hub id (default: the embedded model)"))
    dtype: Dtype = dataclasses.field(default="float32", metadata=_help("weights and KV dtype"))
    device: str = dataclasses.field(default="cpu", metadata=_help("torch device"))
    host: str = dataclasses.field(default="127.0.0.1", metadata=_help("address to bind (other than loopback needs --api-key)"))
    port: int = dataclasses.field(default=8000, metadata=_help("TCP port (0: any free port)"))
    api_key: str | None = dataclasses.field(
        default=None, metadata=_help("key clients send as 'Authorization: Bearer KEY' (or KVLAB_API_KEY)")
    )
    max_num_seqs: int = dataclasses.field(default=8, metadata=_help("requests decoded at once (the running batch)"))
    max_queued_requests: int = dataclasses.field(
        default=64, metadata=_help("requests waiting for a slot; more are refused with 429")
    )
    max_prompt_tokens: int | None = dataclasses.field(
        default=None, metadata=_help("longest prompt accepted (default: the model's context)")
    )
    max_tokens_limit: int = dataclasses.field(
        default=2048, metadata=_help("largest max_tokens a request may ask for (and chat's default)")
    )
    prefill_chunk_tokens: int = dataclasses.field(
        default=512, metadata=_help("prompt tokens prefilled per forward; decoding continues between them")
    )
    mode: Mode = dataclasses.field(default="plain", metadata=_help("default decoding mode: plain, lossy or lossless"))
    drafter: str = dataclasses.field(default="snapkv", metadata=_help("default compressor (drafts in lossless, decodes in lossy)"))
    drafter_args: tuple[str, ...] = dataclasses.field(
        default=(), metadata=_help("default drafter parameter KEY=VALUE")
    )
    num_draft_tokens: int | Literal["auto"] = dataclasses.field(
        default="auto", metadata=_help("default draft length, or auto (adapted per sequence)")
    )
    draft_weights: DraftWeightsName = dataclasses.field(default="same", metadata=_help("draft with the model (same) or a bf16/int8 copy"))
    prefix_store: str | None = dataclasses.field(
        default=None, metadata=_help("prefix store URL (memory://, file:///dir, redis://host:port/db)")
    )
    prefix_chunk_tokens: int = dataclasses.field(default=256, metadata=_help("tokens per stored prefix chunk"))
    fetch_workers: int = dataclasses.field(default=2, metadata=_help("prefix lookups and fetches run at once"))
    max_cache_salts: int = dataclasses.field(default=64, metadata=_help("distinct cache salts kept open at once"))
    shutdown_timeout_s: float = dataclasses.field(
        default=30.0, metadata=_help("on SIGTERM, seconds running requests may take to finish before they are cancelled")
    )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_tokens_limit": self.max_tokens_limit,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "prefix_chunk_tokens": self.prefix_chunk_tokens,
            "fetch_workers": self.fetch_workers,
            "max_cache_salts": self.max_cache_salts,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if self.num_draft_tokens != "auto" and (
            not isinstance(self.num_draft_tokens, int) or isinstance(self.num_draft_tokens, bool) or self.num_draft_tokens < 1
        ):
            raise ConfigError(f"num_draft_tokens must be a positive integer or 'auto', got {self.num_draft_tokens!r}")
        if self.max_queued_requests < 0:
            raise ConfigError(f"max_queued_requests must be at least 0, got {self.max_queued_requests}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"max_prompt_tokens must be at least 1, got {self.max_prompt_tokens}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.shutdown_timeout_s < 0:
            raise ConfigError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("the API key must not be empty")
        if not is_loopback(self.host) and self.api_key is None:
            raise ConfigError(
                f"binding {self.host} exposes the server beyond this machine: set --api-key (or KVLAB_API_KEY), "
                "or bind 127.0.0.1"
            )


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
