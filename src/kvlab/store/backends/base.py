"""The store contract: bytes in, bytes out, by key; backends chosen by URL scheme."""

from __future__ import annotations

import abc
import re
from urllib.parse import urlsplit

from kvlab.errors import ConfigError, KvlabError
from kvlab.registry import Registry

stores: Registry[KVStore] = Registry("store")

# Keys become file names and Redis keys: a narrow alphabet keeps untrusted keys from naming anything
# outside the store (no separators, no "..", no leading dot).
_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}")
# A listing prefix is the start of a key; the alphabet has no glob characters, so backends may use it
# in a match pattern (Redis SCAN MATCH) unescaped.
_PREFIX = re.compile(r"[A-Za-z0-9_.-]{0,200}")


class StoreUnavailableError(KvlabError):
    """The store cannot be reached or read (server down, timeout, disk error); the message says what to do."""


class StoredValueError(KvlabError):
    """One key holds something the store refuses to read as a value: larger than the caller's bound, a
    Redis key of another type, a hard-linked file. A fault of that key, not of the store: the reader
    recomputes the chunk and a writer's `put` replaces what is there."""


class KVStore(abc.ABC):
    """A key-value store of byte strings. Batch methods default to loops; backends may do better.

    Attributes:
        url: Where the store is, with any password masked (`redact_url`): safe to print and log.
        shared: Whether other processes can write to it (False only for a process-local store).
    """

    url: str = ""
    shared: bool = True

    @classmethod
    def from_url(cls, url: str, create: bool = True) -> KVStore:
        """The store at `url` (its scheme is this backend's); every registered scheme implements it,
        wrappers such as `ThrottledStore` are built around another store instead.

        Args:
            create: Create the store where it does not exist yet (a directory, for `file://`); read-only
                callers pass False so that a mistyped URL is an error instead of a new empty store.

        Raises:
            ConfigError: The URL is malformed, or the store does not exist and `create` is False.
        """
        raise ConfigError(f"{cls.__name__} is not opened by URL")

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """The bytes stored under `key`, or None when there are none.

        Args:
            max_bytes: Refuse a larger value before reading it (None: no bound). Every backend learns
                the size first (`fstat`, `STRLEN`) and never holds more than `max_bytes + 1` bytes.

        Raises:
            StoredValueError: The value is larger than `max_bytes`, or is not a value this store wrote.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key` (no error when absent)."""

    def contains(self, key: str) -> bool:
        """Whether `key` holds a value; never reads the value."""
        return self.nbytes(key) is not None

    def put_many(self, items: dict[str, bytes]) -> None:
        for key, data in items.items():
            self.put(key, data)

    def get_many(self, keys: list[str], max_bytes: int | None = None) -> list[bytes | None]:
        """`get` of each key (a key over `max_bytes` raises for the whole batch)."""
        return [self.get(key, max_bytes) for key in keys]

    @abc.abstractmethod
    def keys(self, prefix: str = "") -> list[str]:
        """The stored keys that start with `prefix`, sorted."""

    @abc.abstractmethod
    def nbytes(self, key: str) -> int | None:
        """Size in bytes of the value under `key`, or None when there is none; never reads the value.

        Raises:
            StoredValueError: The key holds something that is not a value (e.g. a Redis hash).
        """

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing to release
        """Release connections or handles (no-op by default)."""


def check_key(key: str) -> str:
    """`key` if it is a valid store key, else ConfigError."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ConfigError(f"invalid store key {key!r}: use 1-200 of A-Z a-z 0-9 _ - . (not starting with '.')")
    return key


def is_key(name: str) -> bool:
    """Whether `name` is a valid store key (for skipping foreign entries when listing)."""
    return bool(_KEY.fullmatch(name))


def check_prefix(prefix: str) -> str:
    """`prefix` if it can start a store key, else ConfigError."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ConfigError(f"invalid key prefix {prefix!r}: use up to 200 of A-Z a-z 0-9 _ - .")
    return prefix


def check_size(key: str, nbytes: int, max_bytes: int | None, where: str) -> None:
    """StoredValueError when the `nbytes` stored under `key` exceed `max_bytes` (shared by every backend)."""
    if max_bytes is not None and nbytes > max_bytes:
        raise StoredValueError(
            f"{where}: the value under {key!r} has {nbytes} bytes, more than the {max_bytes} a value read here "
            "may have; not reading it (a writer replaces it; `kvlab store verify --delete URL` removes such values)"
        )


def check_bytes(data: bytes) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"stores hold bytes, got {type(data).__name__}")
    return bytes(data)


def create_store(url: str, create: bool = True) -> KVStore:
    """A store from its URL: `memory://`, `file:///path/to/dir`, ... (`kvlab ls` lists the schemes).

    Args:
        create: Create a store that does not exist yet (see `KVStore.from_url`).
    """
    try:
        scheme = urlsplit(url).scheme
    except ValueError:
        scheme = ""
    if not scheme:
        raise ConfigError(f"store URL {redact_url(url)!r} has no scheme; use one of: {', '.join(stores.names())}")
    return stores.get(scheme).from_url(url, create)  # type: ignore[attr-defined, no-any-return]


def redact_url(url: str) -> str:
    """`url` with its credentials masked: the one form of a store URL that messages, logs and JSON show.

    Everything between `//` and the last `@` is credentials, even when a password holds unescaped
    `@ : / # ?` that a URL parser would split elsewhere; the user name stays when a password follows it.
    Query values are masked too (`?password=...` is a credential), except the options kvlab knows to
    be harmless (`SHOWN_OPTIONS`); a fragment is masked whole.
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url
    if "@" in rest and not rest.startswith("/"):
        userinfo, _, rest = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        shown = f"{user}:***" if colon and user and not {"/", "?", "#"} & set(user) else "***"
        rest = f"{shown}@{rest}"
    rest, hash_mark, _ = rest.partition("#")
    location, question, query = rest.partition("?")
    if question:
        location += "?" + "&".join(_redact_option(option) for option in query.split("&"))
    return f"{scheme}://{location}" + ("#***" if hash_mark else "")


# URL options whose values are never secret (timeouts, database numbers, paths of certificate files).
SHOWN_OPTIONS = frozenset({"timeout", "db", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})


def _redact_option(option: str) -> str:
    name, equals, _ = option.partition("=")
    return option if not equals or name in SHOWN_OPTIONS else f"{name}=***"
