"""Authenticated prefix chunks: an HMAC-SHA256 tag over a chunk's key and bytes, under a store secret.

Keys are public hash chains, so anyone who can write to a shared store can put any bytes under any
key; checksums only catch accidents. With a secret, every chunk carries a tag that only holders of
the secret can make, bound to the key it is stored under (a valid chunk moved to another key fails
too). The secret comes from `KVLAB_STORE_SECRET`, or from the file `KVLAB_STORE_SECRET_FILE` names,
never from a command line (which other users can read in `ps`).

Sealed value: magic `KVPA`, the 32-byte tag, then the chunk bytes (`kvlab.store.resolution`).
Without a secret, values are the chunk bytes alone and the store is trusted as it is.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from kvlab.codec import CodecError
from kvlab.errors import ConfigError

logger = logging.getLogger(__name__)

SECRET_ENV = "KVLAB_STORE_SECRET"
SECRET_FILE_ENV = "KVLAB_STORE_SECRET_FILE"
# 128 bits: a shorter secret could be guessed offline from any one stored chunk.
MIN_SECRET_BYTES = 16
MAGIC = b"KVPA"
TAG_BYTES = hashlib.sha256().digest_size
_DOMAIN = b"kvlab prefix chunk v1\x00"
# Stores already warned of as unauthenticated in this process (`warn_if_unauthenticated`).
_WARNED_URLS: set[str] = set()
_WARNED_LOCK = threading.Lock()


class ChunkAuthError(CodecError):
    """A stored chunk's tag is missing or does not match its key and bytes under the store secret."""


def load_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The store secret from `KVLAB_STORE_SECRET` or `KVLAB_STORE_SECRET_FILE`, or None when neither is set.

    Raises:
        ConfigError: Both are set, the file cannot be read, or the secret is shorter than 16 bytes. A
            file other users may read (mode wider than 0600) is used, with a warning.
    """
    environ = os.environ if environ is None else environ
    text, path = environ.get(SECRET_ENV), environ.get(SECRET_FILE_ENV)
    if text and path:
        raise ConfigError(f"set either {SECRET_ENV} or {SECRET_FILE_ENV}, not both")
    if path:
        try:
            secret = Path(path).read_bytes().rstrip(b"\r\n")
            mode = Path(path).stat().st_mode & 0o777
        except OSError as error:
            raise ConfigError(f"cannot read the store secret file {path} ({SECRET_FILE_ENV}): "
                              f"{error.strerror or error}") from None
        if mode & 0o077:
            logger.warning("the store secret file %s (%s) has mode %o: other users may read it and forge chunks; "
                           "`chmod 600 %s`", path, SECRET_FILE_ENV, mode, path)
    elif text:
        secret = text.encode("utf-8")
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        source = SECRET_FILE_ENV if path else SECRET_ENV
        raise ConfigError(f"the store secret from {source} has {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                          "random bytes (e.g. `openssl rand -hex 32`)")
    return secret


class ChunkSealer:
    """Adds and checks chunk tags under one secret; with `secret=None` values pass through unchanged.

    Args:
        secret: The store secret (`load_secret()`), or None for a store trusted as it is.
    """

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret

    @classmethod
    def from_environment(cls) -> ChunkSealer:
        return cls(load_secret())

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    @property
    def overhead(self) -> int:
        """Bytes `seal` adds to a chunk (the magic and the tag, or 0 without a secret)."""
        return len(MAGIC) + TAG_BYTES if self._secret is not None else 0

    def seal(self, key: str, data: bytes) -> bytes:
        """The value to store under `key` for the chunk bytes `data`."""
        if self._secret is None:
            return data
        return MAGIC + self._tag(key, data) + data

    def open(self, key: str, value: bytes | memoryview) -> memoryview:
        """The chunk bytes of a value read from under `key`, once its tag is verified.

        Raises:
            ChunkAuthError: The value is not sealed as this sealer expects, or its tag is wrong.
        """
        view = memoryview(value).cast("B")
        sealed = bytes(view[: len(MAGIC)]) == MAGIC
        if self._secret is None:
            if sealed:
                raise ChunkAuthError(f"chunk is authenticated, but no store secret is set ({SECRET_ENV})")
            return view
        if not sealed or len(view) < len(MAGIC) + TAG_BYTES:
            raise ChunkAuthError("chunk carries no authentication tag (written without the store secret)")
        tag, data = view[len(MAGIC) : len(MAGIC) + TAG_BYTES], view[len(MAGIC) + TAG_BYTES :]
        if not hmac.compare_digest(bytes(tag), self._tag(key, data)):
            raise ChunkAuthError("chunk authentication failed: written under another key or without the store secret")
        return data

    def _tag(self, key: str, data: bytes | memoryview) -> bytes:
        assert self._secret is not None
        mac = hmac.new(self._secret, _DOMAIN, hashlib.sha256)
        encoded = key.encode("ascii")
        mac.update(len(encoded).to_bytes(2, "little") + encoded)
        mac.update(data)
        return mac.digest()


def warn_if_unauthenticated(sealer: ChunkSealer, url: str, shared: bool) -> None:
    """Say once per process and store that a shared store without a secret is trusted as it is (a server
    opens one prefix cache per cache salt on the same store: the warning would repeat for each)."""
    if sealer.authenticated or not shared:
        return
    with _WARNED_LOCK:
        if url in _WARNED_URLS:
            return
        _WARNED_URLS.add(url)
    logger.warning(
        "prefix store %s: no %s or %s set, so chunks are not authenticated; anyone who can write to this "
        "store can change what is generated from it", url, SECRET_ENV, SECRET_FILE_ENV,
    )
