"""`redis://host:port/db`: keys and bytes in a Redis server, shared across processes and machines."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast
from urllib.parse import parse_qs, urlparse

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvlab.errors import ConfigError
from kvlab.store.base import KVStore, StoreUnavailableError, check_bytes, check_key, check_prefix, is_key, stores

DEFAULT_PORT = 6379
DEFAULT_TIMEOUT_S = 5.0
NAMESPACE = "kvlab:"
_SCAN_BATCH = 1000


@stores.register("redis")
class RedisStore(KVStore):
    """Values as Redis strings under `kvlab:<key>`, through a thread-safe connection pool.

    URL: `redis://[:password@]host[:port][/db][?timeout=SECONDS]` (defaults localhost, 6379, db 0, 5 s
    for connecting and for each reply). Connecting is lazy: a server that is down or unreachable shows
    up as StoreUnavailableError from the first operation. Values are raw bytes (never pickled); the
    namespace keeps `keys()` to kvlab's own entries in a shared database.
    """

    def __init__(self, url: str, host: str, port: int, db: int, timeout_s: float, password: str | None = None,
                 username: str | None = None) -> None:
        self.url, self.host, self.port = url, host, port
        self._pool = redis.ConnectionPool(
            host=host, port=port, db=db, username=username, password=password,
            socket_connect_timeout=timeout_s, socket_timeout=timeout_s, decode_responses=False,
            # One immediate retry replaces a pooled connection the server dropped (restart, idle
            # timeout); more retries with backoff would only delay the error when the server is down.
            retry=Retry(NoBackoff(), 1),
        )
        self._client = redis.Redis(connection_pool=self._pool)

    @classmethod
    def from_url(cls, url: str) -> RedisStore:
        parsed = urlparse(url)
        try:
            port = parsed.port or DEFAULT_PORT
        except ValueError:
            raise ConfigError(f"redis store URL {url!r} has an invalid port") from None
        db_text = parsed.path.strip("/") or "0"
        if not db_text.isdigit():
            raise ConfigError(f"redis store URL {url!r}: the path must be a database number, e.g. redis://host:6379/0")
        query = parse_qs(parsed.query, keep_blank_values=True)
        unknown = sorted(set(query) - {"timeout"})
        if unknown:
            raise ConfigError(f"redis store URL {url!r}: unknown option {unknown[0]!r}; the only option is timeout")
        timeout_s = _parse_timeout(url, query.get("timeout", [str(DEFAULT_TIMEOUT_S)])[-1])
        # The URL appears in error messages, so the password is masked there.
        shown = url.replace(f":{parsed.password}@", ":***@") if parsed.password else url
        return cls(shown, parsed.hostname or "localhost", port, int(db_text), timeout_s,
                   password=parsed.password, username=parsed.username or None)

    def put(self, key: str, data: bytes) -> None:
        name, payload = _name(key), check_bytes(data)
        with self._errors():
            self._client.set(name, payload)

    def get(self, key: str) -> bytes | None:
        name = _name(key)
        with self._errors():
            return cast("bytes | None", self._client.get(name))

    def delete(self, key: str) -> None:
        name = _name(key)
        with self._errors():
            self._client.delete(name)

    def contains(self, key: str) -> bool:
        name = _name(key)
        with self._errors():
            return bool(self._client.exists(name))

    def put_many(self, items: dict[str, bytes]) -> None:
        named = {_name(key): check_bytes(data) for key, data in items.items()}
        if not named:
            return
        with self._errors():
            pipeline = self._client.pipeline(transaction=False)
            for name, payload in named.items():
                pipeline.set(name, payload)
            pipeline.execute()

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        names = [_name(key) for key in keys]
        if not names:
            return []
        with self._errors():
            return cast("list[bytes | None]", self._client.mget(names))

    def keys(self, prefix: str = "") -> list[str]:
        pattern = NAMESPACE + check_prefix(prefix) + "*"
        with self._errors():
            names = [name.decode("utf-8", "replace") for name in self._client.scan_iter(match=pattern,
                                                                                        count=_SCAN_BATCH)]
        # SCAN may return a key twice; a foreign entry under the namespace is not a kvlab key.
        return sorted({name[len(NAMESPACE):] for name in names if is_key(name[len(NAMESPACE):])})

    def nbytes(self, key: str) -> int | None:
        name = _name(key)
        with self._errors():
            pipeline = self._client.pipeline(transaction=False)
            pipeline.exists(name)
            pipeline.strlen(name)
            exists, length = pipeline.execute()
        return int(length) if exists else None

    def close(self) -> None:
        self._pool.disconnect()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Turn connection failures into StoreUnavailableError that names the URL and the fix."""
        try:
            yield
        except redis.exceptions.AuthenticationError as error:
            raise StoreUnavailableError(
                f"redis store {self.url}: authentication failed ({error}); check the password in the URL"
            ) from error
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as error:
            raise StoreUnavailableError(
                f"redis store {self.url} is unavailable ({error}); is redis-server running on "
                f"{self.host}:{self.port}? start it with `redis-server --port {self.port}`, or fix the URL "
                "(add ?timeout=SECONDS for a slow network)"
            ) from error


def _name(key: str) -> str:
    return NAMESPACE + check_key(key)


def _parse_timeout(url: str, text: str) -> float:
    try:
        timeout_s = float(text)
    except ValueError:
        timeout_s = 0.0
    if not 0 < timeout_s < float("inf"):
        raise ConfigError(f"redis store URL {url!r}: timeout must be a positive number of seconds, got {text!r}")
    return timeout_s
