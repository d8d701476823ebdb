"""`redis://`, `rediss://` (TLS) and `redis+unix://` (local socket): keys and bytes in a Redis server.

URLs::

    redis://[[user]:password@]host[:port][/db][?timeout=SECONDS]
    rediss://[[user]:password@]host[:port][/db][?timeout=..&ssl_ca_certs=PEM&ssl_certfile=PEM&ssl_keyfile=PEM]
    redis+unix://[[user]:password@]/path/to/redis.sock[?db=N&timeout=SECONDS]

Credentials are percent-decoded (write `@ : / # ?` in a password as `%40 %3A %2F %23 %3F`); a URL
without a password takes it from `KVLAB_REDIS_PASSWORD`, which, unlike a command line, other users
cannot read in `ps`. Every message shows the URL through `redact_url`.

A bounded read (`get(key, max_bytes)`) asks for the key's type and `STRLEN` first and then reads with
`GETRANGE 0 max_bytes`, so a huge value is refused unread and one replaced in between still cannot
deliver more than the bound. A key of another type (a hash, a list) is a fault of that key
(`StoredValueError`), never an outage of the store: `put` overwrites it.
"""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvlab.errors import ConfigError
from kvlab.store.backends.base import (
    KVStore,
    StoredValueError,
    StoreUnavailableError,
    check_bytes,
    check_key,
    check_prefix,
    check_size,
    is_key,
    redact_url,
    stores,
)

DEFAULT_PORT = 6379
DEFAULT_TIMEOUT_S = 5.0
NAMESPACE = "kvlab:"
PASSWORD_ENV = "KVLAB_REDIS_PASSWORD"
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_SCAN_BATCH = 1000


@stores.register("redis")
class RedisStore(KVStore):
    """Values as Redis strings under `kvlab:<key>`, through a thread-safe connection pool.

    Defaults: localhost, 6379, db 0, 5 s for connecting and for each reply (see the module docstring
    for the URL forms). Connecting is lazy: a server that is down or unreachable shows up as
    StoreUnavailableError from the first operation. Values are raw bytes (never pickled); the
    namespace keeps `keys()` to kvlab's own entries in a shared database.

    Args:
        url: The store's URL (kept only in redacted form).
        address: `host:port` or the socket path, for messages.
        connection: Keyword arguments of the redis-py connection class (`connection_class` among them).
    """

    def __init__(self, url: str, address: str, connection: dict[str, Any]) -> None:
        self.url, self.address = redact_url(url), address
        self._pool = redis.ConnectionPool(
            decode_responses=False,
            # One immediate retry replaces a pooled connection the server dropped (restart, idle
            # timeout); more retries with backoff would only delay the error when the server is down.
            retry=Retry(NoBackoff(), 1),
            **connection,
        )
        self._client = redis.Redis(connection_pool=self._pool)

    @property
    def host(self) -> str:
        return str(self._pool.connection_kwargs.get("host", "localhost"))

    @property
    def port(self) -> int:
        return int(self._pool.connection_kwargs.get("port", DEFAULT_PORT))

    @classmethod
    def from_url(cls, url: str, create: bool = True) -> RedisStore:
        shown = redact_url(url)
        encode = "percent-encode @ : / # ? in passwords (%40 %3A %2F %23 %3F)"
        try:
            parsed = urlsplit(url)
            port = parsed.port or DEFAULT_PORT
        except ValueError:
            raise ConfigError(f"redis store URL {shown!r} has an invalid port or address; {encode}") from None
        if parsed.fragment:
            raise ConfigError(f"redis store URL {shown!r} holds a '#'; {encode}")
        query = parse_qs(parsed.query, keep_blank_values=True)
        options = {"timeout"} | ({"db"} if parsed.scheme == "redis+unix" else set()) | \
                  (set(TLS_OPTIONS) if parsed.scheme == "rediss" else set())
        unknown = sorted(set(query) - options)
        if unknown:
            raise ConfigError(f"redis store URL {shown!r}: unknown option {unknown[0]!r}; options of "
                              f"{parsed.scheme}://: {', '.join(sorted(options))}")
        timeout_s = parse_timeout(shown, query_option(query, "timeout") or str(DEFAULT_TIMEOUT_S))
        connection: dict[str, Any] = {"socket_timeout": timeout_s, **url_credentials(parsed)}
        if parsed.scheme == "redis+unix":
            if not parsed.path:
                raise ConfigError(f"redis store URL {shown!r}: give the socket path, e.g. redis+unix:///run/redis.sock")
            connection.update(connection_class=redis.UnixDomainSocketConnection, path=unquote(parsed.path),
                              db=_db(shown, query_option(query, "db") or "0"))
            return cls(url, unquote(parsed.path), connection)
        host = parsed.hostname or "localhost"
        connection.update(host=host, port=port, db=_db(shown, parsed.path.strip("/") or "0"),
                          socket_connect_timeout=timeout_s)
        if parsed.scheme == "rediss":
            connection.update(connection_class=redis.SSLConnection, ssl_cert_reqs="required",
                              **_tls_files(shown, query))
        return cls(url, f"{host}:{port}", connection)

    def put(self, key: str, data: bytes) -> None:
        name, payload = _name(key), check_bytes(data)
        with self._errors():
            self._client.set(name, payload)

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        name = _name(key)
        with self._errors(key):
            return bounded_get(self._client, name, key, max_bytes, self.url)

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

    def get_many(self, keys: list[str], max_bytes: int | None = None) -> list[bytes | None]:
        if max_bytes is not None or not keys:  # a bounded read sizes each value first, key by key
            return super().get_many(keys, max_bytes)
        with self._errors():
            return cast("list[bytes | None]", self._client.mget([_name(key) for key in keys]))

    def keys(self, prefix: str = "") -> list[str]:
        pattern = NAMESPACE + check_prefix(prefix) + "*"
        with self._errors():
            names = [name.decode("utf-8", "replace") for name in self._client.scan_iter(match=pattern,
                                                                                        count=_SCAN_BATCH)]
        # SCAN may return a key twice; a foreign entry under the namespace is not a kvlab key.
        return sorted({name[len(NAMESPACE):] for name in names if is_key(name[len(NAMESPACE):])})

    def nbytes(self, key: str) -> int | None:
        name = _name(key)
        with self._errors(key):
            return value_size(self._client, name, key, self.url)

    def close(self) -> None:
        self._pool.disconnect()

    @contextlib.contextmanager
    def _errors(self, key: str | None = None) -> Iterator[None]:
        """Turn server and connection failures into StoreUnavailableError that names the URL and the fix;
        a wrong-type `key` into StoredValueError."""
        try:
            yield
        except redis.exceptions.ResponseError as error:
            raise wrong_type(error, key, self.url) or StoreUnavailableError(
                f"redis store {self.url} refused the request ({error})") from error
        except redis.exceptions.AuthenticationError as error:
            raise StoreUnavailableError(
                f"redis store {self.url}: authentication failed ({error}); check the password in the URL "
                f"or {PASSWORD_ENV}"
            ) from error
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as error:
            if is_tls_failure(error):
                hint = TLS_HINT
            elif isinstance(self._pool.connection_kwargs.get("path"), str):
                hint = f"is redis-server listening on the socket {self.address}? (redis-server --unixsocket PATH)"
            else:
                port = self.port
                hint = (f"is redis-server running on {self.address}? start it with `redis-server --port {port}`, "
                        "or fix the URL (add ?timeout=SECONDS for a slow network)")
            raise StoreUnavailableError(f"redis store {self.url} is unavailable ({error}); {hint}") from error
        except redis.exceptions.RedisError as error:
            # Refusals such as OOM (maxmemory reached) or a read-only replica: the store cannot serve.
            raise StoreUnavailableError(f"redis store {self.url} refused the request ({error})") from error


def _name(key: str) -> str:
    return NAMESPACE + check_key(key)


TLS_HINT = ("the TLS handshake failed: check that ssl_ca_certs is the CA that signed the server's certificate, "
            "that the certificate names the host in the URL, and give ssl_certfile and ssl_keyfile when the server "
            "asks for a client certificate")


def is_tls_failure(error: BaseException) -> bool:
    """Whether a connection failed in the TLS handshake (redis-py keeps only the SSL error's text)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ssl.SSLError) or "SSL" in str(seen) or "certificate" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def value_size(client: Any, name: str, key: str, where: str) -> int | None:
    """Bytes of the string under Redis key `name` (None: no such key); StoredValueError for another type
    (shared by the redis URL schemes)."""
    pipeline = client.pipeline(transaction=False)
    pipeline.type(name)
    pipeline.strlen(name)
    kind, size = pipeline.execute(raise_on_error=False)
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    if kind == "none":
        return None
    if kind != "string":
        raise _wrong_type_error(key, kind, where)
    if isinstance(size, Exception):
        raise size
    return int(size)


def bounded_get(client: Any, name: str, key: str, max_bytes: int | None, where: str) -> bytes | None:
    """The value under Redis key `name`, refused unread when its `STRLEN` exceeds `max_bytes`."""
    if max_bytes is None:
        return cast("bytes | None", client.get(name))
    size = value_size(client, name, key, where)
    if size is None:
        return None
    check_size(key, size, max_bytes, where)
    data = cast(bytes, client.getrange(name, 0, max_bytes))
    if not data and size:
        return None  # removed between the two requests
    check_size(key, len(data), max_bytes, where)  # replaced by a larger value in between
    return data


def wrong_type(error: BaseException, key: str | None, where: str) -> StoredValueError | None:
    """StoredValueError when `error` is Redis's WRONGTYPE for `key`, else None."""
    if key is None or not str(error).startswith("WRONGTYPE"):
        return None
    return _wrong_type_error(key, "non-string", where)


def _wrong_type_error(key: str, kind: str, where: str) -> StoredValueError:
    return StoredValueError(f"{where}: the Redis key {NAMESPACE}{key} holds a {kind}, not a value kvlab wrote; "
                            "not reading it (a writer's put replaces it; `kvlab store verify --delete URL` removes it)")


def query_option(query: dict[str, list[str]], name: str) -> str | None:
    """The last value of `name` in a parsed URL query, or None (shared by the redis URL schemes)."""
    values = query.get(name)
    return values[-1] if values else None


def url_credentials(parsed: SplitResult) -> dict[str, Any]:
    """Username and password from the URL, the password from KVLAB_REDIS_PASSWORD when the URL has none."""
    username = unquote(parsed.username) if parsed.username else None
    password = unquote(parsed.password) if parsed.password is not None else os.environ.get(PASSWORD_ENV)
    return {"username": username or None, "password": password or None}


def _db(shown: str, text: str) -> int:
    if not text.isdigit():
        raise ConfigError(f"redis store URL {shown!r}: the path must be a database number, e.g. redis://host:6379/0")
    return int(text)


def _tls_files(shown: str, query: dict[str, list[str]]) -> dict[str, str]:
    files = {name: value for name in TLS_OPTIONS if (value := query_option(query, name))}
    for name, value in files.items():
        if not Path(value).is_file():
            raise ConfigError(f"redis store URL {shown!r}: {name} file {value!r} not found")
    if ("ssl_certfile" in files) != ("ssl_keyfile" in files):
        raise ConfigError(f"redis store URL {shown!r}: a client certificate needs both ssl_certfile and ssl_keyfile")
    return files


def parse_timeout(shown: str, text: str) -> float:
    try:
        timeout_s = float(text)
    except ValueError:
        timeout_s = 0.0
    if not 0 < timeout_s < float("inf"):
        raise ConfigError(f"redis store URL {shown!r}: timeout must be a positive number of seconds, got {text!r}")
    return timeout_s


@stores.register("rediss")
class RedisTLSStore(RedisStore):
    """`rediss://`: a Redis server over TLS, the certificate checked against `ssl_ca_certs` (or the system CAs)."""


@stores.register("redis+unix")
class RedisUnixStore(RedisStore):
    """`redis+unix:///path/to/redis.sock`: a Redis server on this machine, through its Unix socket."""
