"""What the operator sets when starting `kvlab serve`: limits, per-request defaults, the prefix store."""

from __future__ import annotations

import dataclasses
import ipaddress
import urllib.parse
from typing import Literal, get_args

from kvlab.errors import ConfigError

Mode = Literal["plain", "lossy", "lossless"]
MODES: tuple[Mode, ...] = ("plain", "lossy", "lossless")
# kvlab.models.DTYPES and DraftWeights, spelled out so that `kvlab serve --help` loads no torch.
Dtype = Literal["float32", "bfloat16", "float16"]
DraftWeightsName = Literal["same", "bf16", "int8", "int4"]
DRAFT_WEIGHTS_NAMES: tuple[DraftWeightsName, ...] = get_args(DraftWeightsName)
MetricsPrefix = Literal["kvlab", "vllm"]
# The names a browser on this machine uses for a server bound to loopback.
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
ANY = "*"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclasses.dataclass(frozen=True, slots=True)
class ServeConfig:
    """The server's settings; each field's metadata is its `kvlab serve` help.

    Requests pick their mode, drafter, draft length and cache salt within these; everything that
    touches files, URLs or limits is the operator's alone.
    """

    model: str | None = dataclasses.field(
        default=None,
        metadata=_help("embedded alias, .gguf file, model dir or cached hub id (default: the embedded model)"),
    )
    dtype: Dtype = dataclasses.field(default="float32", metadata=_help("weights and KV dtype"))
    device: str = dataclasses.field(default="cpu", metadata=_help("torch device"))
    unpacked_weights: bool = dataclasses.field(
        default=False, metadata=_help(
            "run linear layers through transformers' own F.linear (logits bit-identical to transformers') "
            "instead of oneDNN-packed weights (a CPU decode step is about 1.2x faster packed)"
        )
    )
    compile_forward: bool = dataclasses.field(
        default=False, metadata=_help(
            "run each forward as one graph compiled by torch.compile (Llama-family models): faster decode steps "
            "after 30-75 s of compiling per weight set on the first request"
        )
    )
    host: str = dataclasses.field(
        default="127.0.0.1", metadata=_help("address to bind (beyond loopback needs --api-key-file or KVLAB_API_KEY)")
    )
    port: int = dataclasses.field(default=8000, metadata=_help("TCP port (0: any free port)"))
    # Never a flag (a command line shows in `ps`): `kvlab serve` reads it from --api-key-file or KVLAB_API_KEY.
    api_key: str | None = dataclasses.field(
        default=None, repr=False, metadata=_help("key clients send as 'Authorization: Bearer KEY'")
    )
    allowed_hosts: tuple[str, ...] = dataclasses.field(
        default=(), metadata=_help(
            "Host header values answered, NAME or NAME:PORT, * for any (default: 127.0.0.1, localhost and [::1] "
            "with the port when bound to loopback, the bound address otherwise, any when bound to 0.0.0.0 or ::)"
        )
    )
    allowed_origins: tuple[str, ...] = dataclasses.field(
        default=(), metadata=_help(
            "web origins (scheme://host[:port], * for any) whose pages may call the API, with CORS headers "
            "(default: only pages the server itself serves)"
        )
    )
    metrics_prefix: MetricsPrefix = dataclasses.field(
        default="kvlab", metadata=_help(
            "name prefix of the /metrics series: kvlab, or vllm (vLLM's names, for clients that read them, "
            "e.g. the speculative-decoding counters of `vllm bench serve`)"
        )
    )
    max_num_seqs: int = dataclasses.field(default=8, metadata=_help("requests decoded at once (the running batch)"))
    max_queued_requests: int = dataclasses.field(
        default=64, metadata=_help(
            "requests waiting for a slot, and apart from them requests waiting for tokens of "
            "max_tokens_in_system; more are refused with 429"
        )
    )
    max_prompt_tokens: int | None = dataclasses.field(
        default=None, metadata=_help("longest prompt accepted (default: the model's context)")
    )
    max_tokens_limit: int = dataclasses.field(
        default=2048, metadata=_help("largest max_tokens a request may ask for (and chat's default)")
    )
    max_tokens_in_system: int = dataclasses.field(
        default=1 << 17, metadata=_help(
            "prompt + max_tokens summed over the requests running and queued, which bounds KV memory; "
            "past it requests wait for tokens in arrival order (429 once max_queued_requests wait)"
        )
    )
    max_tokens_per_request: int | None = dataclasses.field(
        default=None, metadata=_help(
            "prompt + max_tokens one request may hold, all its prompts together (400 past it), so that no "
            "request takes the whole of max_tokens_in_system (default: max_tokens_in_system / max_num_seqs)"
        )
    )
    prefill_chunk_tokens: int = dataclasses.field(
        default=512, metadata=_help("prompt tokens prefilled per forward; decoding continues between them")
    )
    mode: Mode = dataclasses.field(default="plain", metadata=_help(
        "default decoding mode: plain, lossy or lossless (greedy output identical to plain in float32)"
    ))
    drafter: str = dataclasses.field(
        default="snapkv", metadata=_help("default compressor (drafts in lossless, decodes in lossy)")
    )
    drafter_args: tuple[str, ...] = dataclasses.field(
        default=(), metadata=_help("default drafter parameter KEY=VALUE")
    )
    num_draft_tokens: int | Literal["auto"] = dataclasses.field(
        default="auto", metadata=_help("default draft length, or auto (adapted per sequence)")
    )
    draft_weights: DraftWeightsName = dataclasses.field(
        default="same", metadata=_help("draft with the model (same) or a bf16/int8/int4 copy")
    )
    # A name, not the Literal: the flag also takes a comma-separated list, checked in __post_init__.
    allowed_draft_weights: tuple[str, ...] = dataclasses.field(
        default=(), metadata=_help(
            "other draft weights (same, bf16, int8, int4; comma-separated) a lossless request may name in "
            "kvlab.draft_weights, each copy built at start-up (default: only --draft-weights)"
        )
    )
    prefix_store: str | None = dataclasses.field(
        default=None, metadata=_help("prefix store URL (memory://, file:///dir, redis://host:port/db)")
    )
    prefix_chunk_tokens: int = dataclasses.field(default=256, metadata=_help("tokens per stored prefix chunk"))
    fetch_workers: int = dataclasses.field(default=2, metadata=_help("prefix lookups and fetches run at once"))
    max_cache_salts: int = dataclasses.field(default=64, metadata=_help("distinct cache salts kept open at once"))
    shutdown_timeout_s: float = dataclasses.field(
        default=30.0,
        metadata=_help("on SIGTERM, seconds requests in the system may take to finish before they are ended"),
    )

    def __post_init__(self) -> None:
        if self.metrics_prefix not in ("kvlab", "vllm"):
            raise ConfigError(f"metrics_prefix must be kvlab or vllm, got {self.metrics_prefix!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_tokens_limit": self.max_tokens_limit,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "prefix_chunk_tokens": self.prefix_chunk_tokens,
            "fetch_workers": self.fetch_workers,
            "max_cache_salts": self.max_cache_salts,
            "max_tokens_in_system": self.max_tokens_in_system,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        draft = self.num_draft_tokens
        if draft != "auto" and (not isinstance(draft, int) or isinstance(draft, bool) or draft < 1):
            raise ConfigError(f"num_draft_tokens must be a positive integer or 'auto', got {self.num_draft_tokens!r}")
        if self.max_queued_requests < 0:
            raise ConfigError(f"max_queued_requests must be at least 0, got {self.max_queued_requests}")
        for weights in self.allowed_draft_weights:
            if weights not in DRAFT_WEIGHTS_NAMES:
                raise ConfigError(
                    f"allowed draft weights must be among {', '.join(DRAFT_WEIGHTS_NAMES)}, got {weights!r}"
                )
        share = self.max_tokens_per_request
        if share is not None and not 1 <= share <= self.max_tokens_in_system:
            raise ConfigError(
                f"max_tokens_per_request must be in 1..{self.max_tokens_in_system} (max_tokens_in_system), got {share}"
            )
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
                f"binding {self.host} exposes the server beyond this machine: give a key with --api-key-file PATH "
                "(or KVLAB_API_KEY), or bind 127.0.0.1"
            )
        for host in self.allowed_hosts:
            if host != ANY and (not host or any(c in host for c in "/@ \t,") or host != host.strip()):
                raise ConfigError(f"allowed host {host!r} must be NAME or NAME:PORT (e.g. example.org:8000), or *")
        for origin in self.allowed_origins:
            if origin != ANY and normalized_origin(origin) is None:
                raise ConfigError(
                    f"allowed origin {origin!r} must be scheme://host[:port] (e.g. https://example.org), or *"
                )

    @property
    def tokens_per_request(self) -> int:
        """The tokens one request may hold: `max_tokens_per_request`, or an even share of
        `max_tokens_in_system` among `max_num_seqs` requests when it is unset."""
        if self.max_tokens_per_request is not None:
            return self.max_tokens_per_request
        return max(1, self.max_tokens_in_system // self.max_num_seqs)

    @property
    def draft_weights_choices(self) -> tuple[str, ...]:
        """The draft weights a request may name: `draft_weights` (the default) and `allowed_draft_weights`."""
        return tuple(dict.fromkeys((self.draft_weights, *self.allowed_draft_weights)))


@dataclasses.dataclass(frozen=True, slots=True)
class AccessPolicy:
    """Which `Host` and `Origin` headers the server answers (`kvlab.serve.access.AccessGuard` applies it).

    Attributes:
        hosts: Names answered, `NAME` or `NAME:PORT` (`*`: any).
        on_bound_port: `hosts` are the defaults, answered only with the port the connection came in on
            (port 80 may go unnamed): the loopback names when bound to loopback, the bound address
            otherwise, any name when bound to a wildcard address (whose API key guards it).
        origins: Other web origins whose pages may call the server, normalized (`*`: any).
    """

    hosts: frozenset[str]
    on_bound_port: bool
    origins: frozenset[str]

    @classmethod
    def of(cls, config: ServeConfig) -> AccessPolicy:
        origins = frozenset(o if o == ANY else normalized_origin(o) or o for o in config.allowed_origins)
        if config.allowed_hosts:
            return cls(frozenset(host.lower() for host in config.allowed_hosts), False, origins)
        if config.host in ("0.0.0.0", "::", ""):
            return cls(frozenset({ANY}), False, origins)
        bound = f"[{config.host.strip('[]')}]" if ":" in config.host else config.host
        names = LOOPBACK_NAMES if is_loopback(config.host) else ()
        return cls(frozenset({*names, bound.lower()}), True, origins)

    def allows_host(self, host: str, port: int) -> bool:
        """Whether to answer a request whose `Host` header is `host`, received on `port`."""
        if ANY in self.hosts:
            return True
        name, given_port = split_host(host)
        if given_port == -1:
            return False
        if self.on_bound_port:
            return name in self.hosts and (given_port == port or (given_port is None and port == 80))
        return name in self.hosts or f"{name}:{given_port}" in self.hosts

    def allows_origin(self, origin: str) -> bool:
        """Whether pages of `origin`, another than the server's own, may call it (with CORS headers)."""
        return ANY in self.origins or normalized_origin(origin) in self.origins

    @staticmethod
    def is_own_origin(origin: str, host: str) -> bool:
        """Whether `origin` is the server itself, as the (already allowed) `host` names it."""
        return normalized_origin(origin) in (f"http://{host}", f"https://{host}")


def split_host(host: str) -> tuple[str, int | None]:
    """`(name, port)` of a Host header (`[::1]:8000` -> `("[::1]", 8000)`): port None when absent, -1
    when malformed."""
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return host, -1
        name, rest = host[: end + 1], host[end + 1 :]
    else:
        name, colon, port = host.partition(":")
        rest = colon + port
    if not rest:
        return name, None
    digits = rest[1:]
    return (name, int(digits)) if rest[0] == ":" and digits.isdigit() and len(digits) <= 5 else (name, -1)


def normalized_origin(origin: str) -> str | None:
    """`scheme://host[:port]` in lower case, or None when `origin` is not of that form (paths, users...)."""
    try:
        parts = urllib.parse.urlsplit(origin.strip())
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or parts.fragment:
        return None
    if parts.username is not None or parts.password is not None:
        return None
    return f"{parts.scheme}://{parts.netloc}".lower()


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
