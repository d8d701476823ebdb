"""`redis+cluster://`: keys and bytes spread over a Redis Cluster, through redis-py's cluster client.

URL::

    redis+cluster://[[user]:password@]host:port[,host:port...][?timeout=SECONDS]

The listed nodes are only where the client starts: it learns the whole cluster (and later moves of
slots) from them, so one reachable node is enough. Credentials follow `redis://` (percent-encoded, or
`KVLAB_REDIS_PASSWORD`); every message shows the URL through `redact_url`. Bounded reads and keys of
another type behave as in `redis://` (`kvlab.store.redis.bounded_get`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvlab.errors import ConfigError
from kvlab.store.backends.base import (
    KVStore,
    StoreUnavailableError,
    check_bytes,
    check_key,
    check_prefix,
    is_key,
    redact_url,
    stores,
)
from kvlab.store.backends.redis import (
    DEFAULT_TIMEOUT_S,
    NAMESPACE,
    PASSWORD_ENV,
    bounded_get,
    parse_timeout,
    query_option,
    url_credentials,
    value_size,
    wrong_type,
)

_SCAN_BATCH = 1000


@stores.register("redis+cluster")
class RedisClusterStore(KVStore):
    """Values as Redis strings under `kvlab:<key>`, each on the node that owns its hash slot.

    Keys are not hash-tagged: a prefix's chunks spread over every primary, so a fetch reads from all of
    them at once and no node holds a hot prefix alone. Batch reads and writes are split by slot and
    sent to each node (`MGET`/`MSET` per node, not atomic across nodes, which the store never needs).
    Connecting is lazy, like `redis://`: an unreachable cluster, or one whose slots are not all served
    (a primary down without a replica), shows up as StoreUnavailableError from the first operation.

    Args:
        url: The store's URL (kept only in redacted form).
        nodes: `(host, port)` of the nodes the client starts from.
        connection: Keyword arguments for every node's connections (timeouts, credentials).
    """

    def __init__(self, url: str, nodes: list[tuple[str, int]], connection: dict[str, Any]) -> None:
        self.url, self.nodes = redact_url(url), nodes
        self._connection = connection
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, create: bool = True) -> RedisClusterStore:
        shown = redact_url(url)
        parsed = urlsplit(url)
        if parsed.fragment or parsed.path.strip("/"):
            raise ConfigError(f"redis cluster store URL {shown!r}: no database or path (a cluster has db 0 only) "
                              "and no '#'; percent-encode @ : / # ? in passwords")
        query = parse_qs(parsed.query, keep_blank_values=True)
        unknown = sorted(set(query) - {"timeout"})
        if unknown:
            raise ConfigError(f"redis cluster store URL {shown!r}: unknown option {unknown[0]!r}; options: timeout")
        timeout_s = parse_timeout(shown, query_option(query, "timeout") or str(DEFAULT_TIMEOUT_S))
        nodes = [_node(shown, text) for text in parsed.netloc.rpartition("@")[2].split(",")]
        connection = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, **url_credentials(parsed)}
        return cls(url, nodes, connection)

    def put(self, key: str, data: bytes) -> None:
        name, payload = _name(key), check_bytes(data)
        with self._errors() as client:
            client.set(name, payload)

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        name = _name(key)
        with self._errors(key) as client:
            return bounded_get(client, name, key, max_bytes, self.url)

    def delete(self, key: str) -> None:
        name = _name(key)
        with self._errors() as client:
            client.delete(name)

    def contains(self, key: str) -> bool:
        name = _name(key)
        with self._errors() as client:
            return bool(client.exists(name))

    def put_many(self, items: dict[str, bytes]) -> None:
        named = {_name(key): check_bytes(data) for key, data in items.items()}
        if not named:
            return
        with self._errors() as client:
            client.mset_nonatomic(named)

    def get_many(self, keys: list[str], max_bytes: int | None = None) -> list[bytes | None]:
        if max_bytes is not None or not keys:  # a bounded read sizes each value first, key by key
            return super().get_many(keys, max_bytes)
        with self._errors() as client:
            return cast("list[bytes | None]", client.mget_nonatomic([_name(key) for key in keys]))

    def keys(self, prefix: str = "") -> list[str]:
        pattern = NAMESPACE + check_prefix(prefix) + "*"
        with self._errors() as client:
            names = [name.decode("utf-8", "replace") for name in client.scan_iter(match=pattern, count=_SCAN_BATCH)]
        # A key can be listed twice while its slot moves; a foreign entry under the namespace is no kvlab key.
        return sorted({name[len(NAMESPACE):] for name in names if is_key(name[len(NAMESPACE):])})

    def nbytes(self, key: str) -> int | None:
        name = _name(key)
        with self._errors(key) as client:
            # TYPE then STRLEN: both go to the key's node, and an empty value still exists.
            return value_size(client, name, key, self.url)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _connect(self) -> RedisCluster:
        with self._lock:
            if self._client is None:
                self._client = RedisCluster(
                    startup_nodes=[ClusterNode(host, port) for host, port in self.nodes],
                    decode_responses=False,
                    # One retry lets the client follow a moved slot or a replica's promotion; more would
                    # only delay the fallback to compute when a node is down.
                    retry=Retry(NoBackoff(), 1),
                    **self._connection,
                )
            return self._client

    @contextlib.contextmanager
    def _errors(self, key: str | None = None) -> Iterator[RedisCluster]:
        """The cluster client; node and cluster failures become StoreUnavailableError naming the URL and the
        fix, a wrong-type `key` StoredValueError (the cluster is fine)."""
        addresses = ",".join(f"{host}:{port}" for host, port in self.nodes)
        try:
            yield self._connect()
        except redis.exceptions.ResponseError as error:
            fault = wrong_type(error, key, self.url)
            if fault is not None:
                raise fault from error
            self._forget_topology()
            raise StoreUnavailableError(f"redis cluster store {self.url} cannot serve ({error}); check "
                                        f"`redis-cli -h HOST -p PORT cluster info` on {addresses}") from error
        except redis.exceptions.AuthenticationError as error:
            raise StoreUnavailableError(
                f"redis cluster store {self.url}: authentication failed ({error}); check the password in the URL "
                f"or {PASSWORD_ENV}"
            ) from error
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
                RedisClusterException) as error:
            # RedisClusterException (no startup node reachable) is not a RedisError.
            raise StoreUnavailableError(
                f"redis cluster store {self.url} is unavailable ({error}); are the nodes {addresses} running with "
                "--cluster-enabled yes? (add ?timeout=SECONDS for a slow network)"
            ) from error
        except redis.exceptions.RedisError as error:
            # A slot without a live primary (ClusterDownError), a node not in cluster mode, OOM, ...
            self._forget_topology()
            raise StoreUnavailableError(f"redis cluster store {self.url} cannot serve ({error}); check "
                                        f"`redis-cli -h HOST -p PORT cluster info` on {addresses}") from error

    def _forget_topology(self) -> None:
        """Drop the client so that the next operation learns the cluster's slots afresh."""
        self.close()


def _name(key: str) -> str:
    return NAMESPACE + check_key(key)


def _node(shown: str, text: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = text, "6379"
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"redis cluster store URL {shown!r}: give the nodes as host:port,host:port, got {text!r}")
    return host, int(port)
